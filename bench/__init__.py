"""reach-mesh benchmark harness: ``make bench`` / ``python -m bench [--quick] [--profile]``.

Every figure the project quotes comes out of this package. It starts its own nats-server, runs
the hub and the responders (the reach-mesh agent, a raw nats-py queue-group responder, a
hand-written ``nats.micro`` service, an ``agentbus`` worker) in separate processes, drives them
from this process (uvloop when installed), and writes ``bench/results/latest.json`` and
``docs/benchmarks.md``.

Modules: ``_load`` (open/closed-loop generators, percentiles), ``_procs`` (child-process entry
points), ``_system`` (machine, versions, /proc sampling), ``_jsstats`` (JetStream operations,
bytes and CPU per unit of work, from the server's statistics and /proc), ``routed`` (routed
request-reply, peers, tracing overhead, hub profile), ``registry_scale`` (1k/10k heartbeating
agents), ``peer_taskiq`` (taskiq + taskiq-nats doing the workflows' fanout and chain),
``report`` and ``report_workflows`` (the results page). ``selector_bench``,
``tracing_overhead`` and ``workflow_bench`` are owned by the engineers of those features and
only imported here.
"""
