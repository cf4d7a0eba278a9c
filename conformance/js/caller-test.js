// Checks of the JS caller (caller.js) against a running mesh: a hub and the Python agents
// of tests/test_conformance_js.py in namespace REACH_NAMESPACE. Each check asserts a real
// outcome; the exit code is 0 iff all hold.
//
//   node caller-test.js [routing] [idempotency] [workflows] [trace]   (default: all four)
// Environment: REACH_NATS_URL, REACH_NAMESPACE (required), secure mode: REACH_NKEY_SEED_FILE
// (the caller identity's seed) and REACH_INBOX_PREFIX (_INBOX.caller.<namespace>).
// Exit codes: 0 all checks hold, 1 a check failed or an exception, 2 bad usage.
'use strict';
const crypto = require('crypto');
const { ReachClient, ReachError, newTraceparent, traceIdOf, newTaskId, sc } = require('./caller');

const URL = process.env.REACH_NATS_URL || 'nats://127.0.0.1:4222';
const NS = process.env.REACH_NAMESPACE || '';
const SEED = process.env.REACH_NKEY_SEED_FILE;
const INBOX = process.env.REACH_INBOX_PREFIX;
const SECURE = !!SEED;
const PARTS = ['routing', 'idempotency', 'workflows', 'trace'];
const wanted = process.argv.slice(2).length ? process.argv.slice(2) : PARTS;
if (!NS || wanted.some((p) => !PARTS.includes(p))) {
  console.error(`usage: REACH_NAMESPACE=ns node caller-test.js [${PARTS.join('] [')}]`);
  process.exit(2);
}
// The Python agents' ids (tests/test_conformance_js.py, caller_agents).
const W1 = `${NS}.worker.w1`; const W2 = `${NS}.worker.w2`; const W3 = `${NS}.worker.w3`;
const S1 = `${NS}.single.s1`; const F1 = `${NS}.failer.f1`;

let passed = 0; const failures = [];
function check(name, cond, extra) {
  if (cond) { passed++; console.log(`  ok   ${name}`); } else {
    failures.push(name); console.log(`  FAIL ${name}${extra !== undefined ? ' :: ' + JSON.stringify(extra).slice(0, 600) : ''}`);
  }
}
async function expectError(name, code, fn, detailCheck) {
  try {
    const r = await fn();
    check(`${name} -> ${code}`, false, r.reply ?? r);
  } catch (e) {
    check(`${name} -> ${code}`, e instanceof ReachError && e.code === code, { code: e.code, msg: e.message, details: e.details });
    if (detailCheck && e instanceof ReachError) detailCheck(e);
  }
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function runsOf(c, taskIds) {
  // how many times each task id ran, over every agent that counts runs (cf:count:v1 by id)
  const tot = {};
  for (const a of [W1, W2, W3, F1]) {
    const { reply } = await c.route({ agent_id: a, capability: 'cf:count:v1', payload: { task_ids: taskIds } });
    for (const [t, n] of Object.entries(reply.task.result.runs)) tot[t] = (tot[t] || 0) + n;
  }
  return tot;
}

async function part1(c) {
  console.log('== 1. routing and typed errors');
  let r = await c.route({ capability: 'cf:echo:v1', payload: { hello: 'cap' } });
  check('route by capability SUCCEEDED', r.reply.task.state === 'SUCCEEDED' && r.reply.task.result.echo.hello === 'cap', r.reply);
  check('RouteReply.agent_id == task.agent_id', r.reply.agent_id === r.reply.task.agent_id);
  check('task_id echoed', r.reply.task.task_id === r.task_id);

  r = await c.route({ agent_id: W2, capability: 'cf:echo:v1', payload: { hello: 'id' } });
  check('route by agent_id+capability reaches that agent', r.reply.task.state === 'SUCCEEDED' && r.reply.agent_id === W2, r.reply);
  r = await c.route({ agent_id: S1, payload: { hello: 'id-only' } });
  check('route by agent_id alone (single-handler agent)', r.reply.task.state === 'SUCCEEDED' && r.reply.task.result.only === true, r.reply);
  await expectError('route by agent_id alone to multi-handler agent', 'REACH_NO_HANDLER',
    () => c.route({ agent_id: W1, payload: {} }));

  // unknown agent: per protocol.md a route by agent_id not in the registry is REACH_NO_MATCH
  await expectError('unknown agent id (not registered)', 'REACH_NO_MATCH',
    () => c.route({ agent_id: `${NS}.nosuch.x1`, payload: {} }));
  // registered agent that is not subscribed: REACH_UNKNOWN_AGENT (no responders). We register
  // a fake agent ourselves (RegisterRequest) that never subscribes.
  const ghost = `${NS}.ghost.g1`;
  if (SECURE) { console.log('  (secure mode: a caller cannot register the ghost agent; skipped)'); } else {
  const sess = crypto.randomBytes(16).toString('hex');
  await c.hubRequest(`reach.hub.${NS}.register.ghost.g1`, {
    card: { agent_id: ghost, capabilities: ['cf:ghost:v1'] }, session: sess,
    heartbeat_interval: 5.0, lease_timeout: 15.0,
  });
  // The hub waits for it (it may be reconnecting) until the route's timeout: a short one.
  await expectError('registered agent with no subscriber', 'REACH_UNKNOWN_AGENT',
    () => c.route({ agent_id: ghost, payload: {}, timeout: 1 }),
    (e) => check('  details.agent_id names it', e.details.agent_id === ghost, e.details));
  const un = await c.hubRequest(`reach.hub.${NS}.unregister.ghost.g1`, { agent_id: ghost, session: sess });
  check('unregister ghost removed', un.body.removed === true, un.body);
  }

  await expectError('no match for capability', 'REACH_NO_MATCH',
    () => c.route({ capability: 'cf:ecko:v1', payload: {} }),
    (e) => check('  details.similar_capabilities suggests cf:echo:v1',
      Array.isArray(e.details.similar_capabilities) && e.details.similar_capabilities.includes('cf:echo:v1'), e.details));
  await expectError('bad selector', 'REACH_BAD_SELECTOR',
    () => c.route({ selector: 'cap=cf:echo:v1 OR region=eu-west', payload: {} }),
    (e) => check('  details.position/expected', typeof e.details.position === 'number' && typeof e.details.expected === 'string', e.details));
  await expectError('malformed JSON body', 'REACH_BAD_REQUEST',
    () => c.hubRequest(`reach.hub.${NS}.route`, '{"capability": "cf:echo:v1", ', { raw: true }));
  await expectError('wrong field type (timeout "5")', 'REACH_BAD_REQUEST',
    () => c.route({ capability: 'cf:echo:v1', timeout: '5' }),
    (e) => check('  details.field == timeout', e.details.field === 'timeout', e.details));
  await expectError('two targets', 'REACH_BAD_REQUEST',
    () => c.route({ capability: 'cf:echo:v1', selector: 'cap=cf:echo:v1' }));
  await expectError('unknown strategy', 'REACH_BAD_REQUEST',
    () => c.route({ capability: 'cf:echo:v1', strategy: 'fastest' }));
  await expectError('bad capability format', 'REACH_BAD_CAPABILITY',
    () => c.route({ capability: 'Echo', payload: {} }));
  await expectError('oversized payload (2 MiB)', 'REACH_PAYLOAD_TOO_LARGE',
    () => c.route({ capability: 'cf:echo:v1', payload: { s: 'x'.repeat(2 * 1024 * 1024) } }),
    (e) => check('  details.size/max_size', e.details.size > e.details.max_size, e.details));

  r = await c.route({ capability: 'cf:fail:v1', payload: {} });
  check('handler failure (TaskFailed retryable=False) -> task FAILED REACH_HANDLER_FAILED, retryable false',
    r.reply.task.state === 'FAILED' && r.reply.task.error.code === 'REACH_HANDLER_FAILED' &&
    r.reply.task.error.details.retryable === false, r.reply);
  r = await c.route({ capability: 'cf:boom:v1', payload: {} });
  check('handler exception -> task FAILED REACH_HANDLER_FAILED', r.reply.task.state === 'FAILED' &&
    r.reply.task.error.code === 'REACH_HANDLER_FAILED', r.reply);

  // selector + strategy
  r = await c.route({ selector: 'cap=cf:echo:v1 AND region=eu-west AND mem_gte=10GiB', strategy: 'least_loaded', payload: {}, explain: true });
  check('selector least_loaded picks the only match (w1: mem_gb=16, eu-west)', r.reply.agent_id === W1 &&
    r.reply.decision && r.reply.decision.strategy === 'least_loaded', r.reply);
  const seen = new Set();
  for (let i = 0; i < 6; i++) {
    r = await c.route({ selector: 'cap=cf:echo:v1 AND tier=gold', strategy: 'round_robin', payload: { i } });
    seen.add(r.reply.agent_id);
  }
  check('selector tier=gold round_robin spreads over w1 and w2 only', seen.size === 2 && seen.has(W1) && seen.has(W2), [...seen]);
  r = await c.route({ selector: 'cap=cf:echo:v1 AND region=eu-west', dry_run: true });
  check('dry_run returns subject and decision, no task', r.reply.subject && r.reply.subject.startsWith(`reach.agent.${NS}.worker.`) && !r.reply.task && r.reply.decision, r.reply);

  // direct mode
  const d = await c.routeDirect({ selector: 'cap=cf:echo:v1 AND region=us-east', payload: { direct: true } });
  check('direct mode: TaskEnvelope sent by caller, agent answers TaskReply', d.reply.state === 'SUCCEEDED' && d.reply.agent_id === W3, d.reply);
}

async function part2(c) {
  console.log('== 2. idempotency');
  const t = newTaskId();
  const a = await c.route({ capability: 'cf:echo:v1', payload: { n: 1 }, task_id: t });
  const b = await c.route({ capability: 'cf:echo:v1', payload: { n: 1 }, task_id: t });
  check('retry by capability: same agent (pinned)', a.reply.agent_id === b.reply.agent_id, [a.reply.agent_id, b.reply.agent_id]);
  check('retry by capability: cached:true, same result', b.reply.task.cached === true && b.reply.task.result.runs === 1, b.reply.task);
  const c2 = await c.route({ agent_id: a.reply.agent_id, capability: 'cf:echo:v1', payload: { n: 1 }, task_id: t });
  check('retry by agent_id: cached:true', c2.reply.task.cached === true, c2.reply.task);

  // concurrent duplicates of a slow task
  const ts = newTaskId();
  const [x, y] = await Promise.all([
    c.route({ capability: 'cf:slow:v1', payload: { sleep: 1 }, task_id: ts }),
    c.route({ capability: 'cf:slow:v1', payload: { sleep: 1 }, task_id: ts }),
  ]);
  check('concurrent duplicates: both SUCCEEDED on one agent', x.reply.task.state === 'SUCCEEDED' && y.reply.task.state === 'SUCCEEDED' &&
    x.reply.agent_id === y.reply.agent_id, [x.reply, y.reply]);

  // failed task: same id answers the stored failure
  const tf = newTaskId();
  const f1 = await c.route({ capability: 'cf:fail:v1', payload: {}, task_id: tf });
  const f2 = await c.route({ capability: 'cf:fail:v1', payload: {}, task_id: tf });
  check('failed task retried with same id: stored failure, cached', f2.reply.task.state === 'FAILED' && f2.reply.task.cached === true, f2.reply.task);

  const runs = await runsOf(c, [t, ts, tf]);
  check('each task ran exactly once over the whole fleet', runs[t] === 1 && runs[ts] === 1 && runs[tf] === 1, runs);
}

async function part3(c) {
  console.log('== 3. workflows');
  const fan = await c.submitWorkflow('fanout', [
    { capability: 'cf:echo:v1', payload: { i: 0 } },
    { selector: 'cap=cf:echo:v1 AND region=us-east', payload: { i: 1 } },
    { agent_id: S1, payload: { i: 2 } },
  ], { policy: 'all', timeout: 30 });
  check('submit: pub-ack from REACH_WF, not duplicate', fan.ack.stream === 'REACH_WF' && fan.ack.duplicate === false, fan.ack);
  const wf = await c.waitWorkflow(fan, 30000);
  check('fanout(3) SUCCEEDED via .done', wf.result.state === 'SUCCEEDED' && wf.source === 'done', wf.result);
  check('fanout result is per-branch list of 3', Array.isArray(wf.result.result) && wf.result.result.length === 3 &&
    wf.result.result[1].agent === W3 && wf.result.result[2].only === true, wf.result.result);
  check('spec_digest computed in JS == hub\'s', wf.result.spec_digest === fan.digest, [wf.result.spec_digest, fan.digest]);
  const rec = await c.workflowRecord(fan.id);
  check('reach_workflows record final with same result', !rec.missing && rec.value.state === 'SUCCEEDED' &&
    JSON.stringify(rec.value.result.result) === JSON.stringify(wf.result.result), rec);

  const ch = await c.submitWorkflow('chain', [
    { capability: 'cf:inc:v1', payload: { n: 1 } },
    { capability: 'cf:inc:v1' },
  ], { timeout: 30 });
  const wc = await c.waitWorkflow(ch, 30000);
  check('chain(2) SUCCEEDED, result n=3', wc.result.state === 'SUCCEEDED' && wc.result.result.n === 3, wc.result);
  check('chain spec_digest matches', wc.result.spec_digest === ch.digest);

  // resubmission of the same id and spec: same workflow; pub-ack not duplicate (new nonce)
  const again = await c.submitWorkflow('chain', [
    { capability: 'cf:inc:v1', payload: { n: 1 } },
    { capability: 'cf:inc:v1' },
  ], { timeout: 30, workflowId: ch.id });
  const wa = await c.waitWorkflow(again, 10000).catch((e) => ({ err: e }));
  const recA = await c.workflowRecord(ch.id);
  check('resubmitting a finished id with the same spec: the record keeps the first result',
    !recA.missing && recA.value.result && recA.value.result.finished_at === wc.result.finished_at, { wa: wa.err ? wa.err.message : wa.source, rec: recA.value && recA.value.result && recA.value.result.finished_at });

  // conflict: same id, other steps
  const conf = await c.submitWorkflow('chain', [{ capability: 'cf:inc:v1', payload: { n: 100 } }], { timeout: 30, workflowId: ch.id });
  const pre = await c.workflowRecord(ch.id);
  check('conflict detectable before waiting (record spec_digest != ours)', !pre.missing && pre.value.spec_digest !== conf.digest, pre.value && pre.value.spec_digest);
  conf.sub.unsubscribe();

  // spec_digest with numbers JS and the hub write differently (a float in [1e-6, 1e-5))
  const odd = await c.submitWorkflow('fanout', [{ capability: 'cf:echo:v1', payload: { a: 0.000002, b: [1e-7, 1.5, 3], c: 'é\u2028', d: null } }], { timeout: 10 });
  const wo = await c.waitWorkflow(odd, 10000).catch((e) => ({ err: e }));
  check('spec_digest with a float in [1e-6, 1e-5) matches (canonical number form)', wo.result && wo.result.spec_digest === odd.digest, wo.err ? wo.err.message : wo.result.spec_digest);

  // events of a slower workflow
  const slow = await c.submitWorkflow('fanout', [
    { capability: 'cf:slow:v1', payload: { sleep: 0.6 } },
    { capability: 'cf:slow:v1', payload: { sleep: 1.2 } },
    { capability: 'cf:echo:v1', payload: { quick: 1 } },
  ], { timeout: 30 });
  const ws = await c.waitWorkflow(slow, 30000);
  const ev = await c.workflowEvents(slow.id);
  check('events: start + step events read from REACH_WF_EVENTS', ws.result.state === 'SUCCEEDED' && ev.events.length === ev.count &&
    ev.events[0] && ev.events[0].kind === 'start' && ev.events.some((e) => e.kind === 'step'), ev.events);

  // cancel a running chain
  const cc = await c.submitWorkflow('chain', [
    { capability: 'cf:slow:v1', payload: { sleep: 20 } },
    { capability: 'cf:inc:v1', payload: { n: 5 } },
  ], { timeout: 60 });
  await sleep(1000);
  const view = await c.workflowView(cc.id);
  check('workflow view: RUNNING, step 0 taken', view.state === 'RUNNING' && view.steps[0].attempt === 1, view);
  const cr = await c.cancelWorkflow(cc.id, { reason: 'js caller test' });
  check('cancel: final, cancelled, FAILED REACH_WORKFLOW_CANCELLED', cr.final === true && cr.cancelled === true &&
    cr.result.error.code === 'REACH_WORKFLOW_CANCELLED', cr);
  const wcc = await c.waitWorkflow(cc, 10000);
  check('cancelled workflow .done/record says REACH_WORKFLOW_CANCELLED, steps cancelled',
    wcc.result.state === 'FAILED' && wcc.result.error.code === 'REACH_WORKFLOW_CANCELLED' &&
    wcc.result.steps.every((s) => s.cancelled === true), wcc.result);
  await expectError('cancel of an unknown workflow id', 'REACH_UNKNOWN_WORKFLOW',
    () => c.cancelWorkflow('nosuchworkflow123', { timeoutMs: 1000 }));

  // malformed submission: the hub stores and announces a FAILED result
  const bad = await c.submitWorkflow('fanout', [], { timeout: 10 });
  const wb = await c.waitWorkflow(bad, 10000).catch((e) => ({ err: e }));
  check('malformed spec (no steps) -> FAILED REACH_BAD_WORKFLOW', wb.result && wb.result.state === 'FAILED' &&
    wb.result.error.code === 'REACH_BAD_WORKFLOW', wb.result || wb.err.message);
  return { fan, wf, ch, wc, slow, ev };
}

async function part4(c, wfs) {
  console.log('== 4. trace context');
  const tp = newTraceparent();
  const r = await c.route({ capability: 'cf:echo:v1', payload: {} }, { traceparent: tp });
  check('proxy route: the agent sees the caller\'s trace id', r.reply.task.result.trace_id === traceIdOf(tp), [r.reply.task.result.trace_id, tp]);
  const tp2 = newTraceparent();
  const d = await c.routeDirect({ capability: 'cf:echo:v1', payload: {} }, { traceparent: tp2 });
  const replyTp = d.replyHeaders && d.replyHeaders.get('traceparent');
  check('direct mode: agent\'s TaskReply carries traceparent with the same trace id', traceIdOf(replyTp) === traceIdOf(tp2), [replyTp, tp2]);
  const bad = '00-' + 'A'.repeat(32) + '-' + 'b'.repeat(16) + '-01';
  const r3 = await c.route({ capability: 'cf:echo:v1', payload: {} }, { traceparent: bad });
  check('invalid traceparent (upper-case hex) is replaced by a new trace', r3.reply.task.result.trace_id &&
    r3.reply.task.result.trace_id !== 'a'.repeat(32) && /^[0-9a-f]{32}$/.test(r3.reply.task.result.trace_id), r3.reply.task.result.trace_id);
  const spaced = newTraceparent();
  const r4 = await c.route({ capability: 'cf:echo:v1', payload: {} }, { traceparent: ' \t' + spaced + ' ' });
  check('traceparent with spaces/tabs around it is kept', r4.reply.task.result.trace_id === traceIdOf(spaced), [r4.reply.task.result.trace_id, spaced]);

  if (wfs) {
    const { fan, wf, ch, wc, slow, ev } = wfs;
    check('workflow: WorkflowResult.trace_id == submitted trace id (fanout)', wf.result.trace_id === fan.trace_id, [wf.result.trace_id, fan.trace_id]);
    check('workflow: every step ran under that trace id (fanout)', wf.result.steps.every((s) => s.result.trace_id === fan.trace_id));
    check('workflow: chain steps ran under the submitted trace id', wc.result.trace_id === ch.trace_id &&
      wc.result.steps.every((s) => s.result.trace_id === ch.trace_id));
    check('workflow: .done carries traceparent of the trace', fan.doneHeaders.length > 0 && traceIdOf(fan.doneHeaders[0].get('traceparent')) === fan.trace_id);
    check('workflow: events carry traceparent of the trace', ev.headers.length > 0 && ev.headers.every((h) => traceIdOf(h.get('traceparent')) === slow.trace_id));
  } else console.log('  (workflows not run: their trace checks skipped)');

  // audit: the route event carries trace_id (REACH_AUDIT, NDJSON batches) - operator only
  if (SECURE) { console.log('  (secure mode: audit is an operator query; skipped)'); return; }
  await sleep(300);
  const events = await readAudit(c, `reach.audit.${NS}.route`);
  const mine = events.find((e) => e.task_id === r.task_id);
  check('audit route event for our task carries our trace id', mine && mine.trace_id === traceIdOf(tp), mine);
}

async function readAudit(c, subject) {
  const oc = await c.js.consumers.get('REACH_AUDIT', { filterSubjects: [subject] });
  const info = await oc.info(true);
  const out = [];
  let left = info.num_pending;
  while (left > 0) {
    const m = await oc.next({ expires: 1000 });
    if (!m) break;
    left--;
    for (const line of sc.decode(m.data).split('\n')) if (line) out.push(JSON.parse(line));
  }
  await oc.delete().catch(() => {});
  return out;
}

(async () => {
  const c = await ReachClient.connect(URL, NS, { seedFile: SEED, inboxPrefix: INBOX });
  const t0 = Date.now();
  try {
    if (wanted.includes('routing')) await part1(c);
    if (wanted.includes('idempotency')) await part2(c);
    const wfs = wanted.includes('workflows') ? await part3(c) : null;
    if (wanted.includes('trace')) await part4(c, wfs);
  } catch (e) {
    failures.push(`exception: ${e.stack}`);
    console.log('EXCEPTION', e);
  }
  await c.close();
  console.log(`\n${passed} passed, ${failures.length} failed in ${Date.now() - t0} ms`);
  if (failures.length) console.log('failed:\n - ' + failures.join('\n - '));
  process.exit(failures.length ? 1 : 0);
})();
