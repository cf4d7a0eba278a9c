"""NATS identities for a secure mesh: nkeys, subject permissions per role, the server's auth file.

Secure mode is opt-in (``reach-mesh auth init DIR``, ``reach-mesh up --secure DIR``): the default
dev mode runs an open server. What nats-server enforces here, and why config-file nkey users
rather than decentralized JWT, is in docs/security.md.

An auth directory holds::

    identities.json        what was issued: role, name, public nkey (no secrets)
    auth.conf              accounts { REACH { users: [...] } }, generated from identities.json
    nats.conf              a complete server config that includes auth.conf (docker, nats-server -c)
    <role>.<name>.nk       an identity's nkey seed (mode 0600): its only secret
    <role>.<name>.yaml     reach-mesh settings for it (REACH_CONFIG): seed file and inbox prefix

Roles: ``hub`` (trusted: the registry, task and workflow state, audit, control), ``agent`` (one
identity per agent id, bound to it by subject), ``caller`` (one namespace), ``operator`` (admin
verbs and fleet-wide reads). Permissions are computed from role and name each time auth.conf is
written, so a newer reach-mesh regenerates them consistently (``reach-mesh auth add-*``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from reach_mesh import protocol
from reach_mesh.config import MeshSettings, load_settings
from reach_mesh.errors import BadRequestError

__all__ = [
    "ACCOUNT",
    "ROLES",
    "AuthDir",
    "Identity",
    "auth_config",
    "hub_replies",
    "inbox_prefix",
    "new_seed",
    "permissions",
    "requester_of",
    "server_config",
    "settings_for",
    "validate_identity",
]

#: The one account every identity of a mesh lives in: hubs serve every namespace and share one
#: JetStream registry, so tenants are told apart by subject permissions, not by accounts.
ACCOUNT: Final = "REACH"
ROLES: Final = ("hub", "agent", "caller", "operator")
_IDENTITIES: Final = "identities.json"
_AUTH_CONF: Final = "auth.conf"
_NATS_CONF: Final = "nats.conf"
_LOCK: Final = ".auth.lock"

# JetStream API prefix and the streams / buckets of the mesh.
_API: Final = "$JS.API"
_KV_TASKS_STREAM: Final = f"KV_{protocol.KV_TASKS}"
_KV_WORKFLOWS_STREAM: Final = f"KV_{protocol.KV_WORKFLOWS}"


@dataclass(frozen=True, slots=True)
class Identity:
    """One issued NATS user: its role, its name (agent id, namespace, or a label) and public
    nkey."""

    role: str
    name: str
    public_key: str

    @property
    def inbox_prefix(self) -> str:
        """Its private reply subjects: ``_INBOX.<role>.<name>`` (nobody else may subscribe)."""
        return inbox_prefix(self.role, self.name)


def hub_replies(ns: str) -> str:
    """What an agent of ``ns`` may answer a hub on: ``_INBOX.hub.*.r.<ns>.>``, the reply
    subjects every hub gives the requests it sends agents of ``ns`` (hub/_reply_boxes.py)."""
    return inbox_prefix("hub", "*") + f".r.{ns}.>"


def inbox_prefix(role: str, name: str) -> str:
    """``_INBOX.<role>.<name>``: the reply prefix of an identity (``*`` allowed in patterns)."""
    return f"_INBOX.{role}.{name}"


def requester_of(reply: str | None) -> str | None:
    """``<role>.<name>`` of the identity whose inbox ``reply`` is under
    (``_INBOX.<role>.<name>.…``), or None: no reply, or nats-py's plain ``_INBOX.<token>…``
    (a process with no inbox prefix of its own, as in open mode).

    What this proves is the NATS permissions' word: only that identity may subscribe there,
    so only it reads the answer. A publisher's reply subject is not checked, though: one that
    may send the request can name another identity's inbox and act blind in its name."""
    if reply is None or not reply.startswith(protocol.INBOX_PREFIX):
        return None
    parts = reply.split(".")
    role = parts[1]
    tokens = 3 if role == "agent" else 1  # an agent's name is its id: <ns>.<service>.<name>
    # The name, then at least one token of the identity's own (nats-py: <nuid>.<token>).
    if role not in ROLES or len(parts) < 3 + tokens:
        return None
    name = ".".join(parts[2 : 2 + tokens])
    try:
        validate_identity(role, name)
    except BadRequestError:
        return None
    return f"{role}.{name}"


def validate_identity(role: str, name: str) -> str:
    """Check ``name`` for ``role``: an agent id, a namespace, or a label token."""
    if role not in ROLES:
        raise BadRequestError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    if role == "agent":
        return protocol.validate_agent_id(name)
    return protocol.validate_namespace(name)


def permissions(role: str, name: str) -> dict[str, Any]:
    """The nats-server ``permissions`` block of an identity (publish / subscribe allow lists).

    Everything not listed is refused by the server with a permissions violation."""
    inbox = inbox_prefix(role, name) + ".>"
    if role == "hub":
        return {
            "publish": {
                "allow": [
                    "reach.>",  # replies aside, everything a hub sends starts here
                    # Creates and reads streams, buckets, consumers; and asks the leader of
                    # the submissions consumer to step down when it sits on a stale copy of
                    # REACH_WF: $JS.API.CONSUMER.LEADER.STEPDOWN.REACH_WF.reach-hubs
                    # (hub/_stale_leader.py; docs/security.md).
                    f"{_API}.>",
                    "$KV.>",  # the only writer of registry, task and workflow records
                    "$JS.ACK.>",
                    "$JS.FC.>",
                    "_INBOX.>",  # answers to requests of every identity
                ]
            },
            "subscribe": {
                "allow": [
                    "reach.hub.>",
                    "reach.hubs.>",
                    "reach.status.>",
                    # NATS micro: discovery ($SRV.PING/INFO/STATS) and the hub's endpoints.
                    "$SRV.>",
                    "reach.micro.>",
                    inbox,
                ]
            },
        }
    if role == "agent":
        agent_id = name
        ns = protocol.namespace_of(agent_id)
        durable = protocol.work_consumer(agent_id)
        status_name = protocol.status_consumer(agent_id)
        own_status = protocol.task_status(agent_id, ">")
        own_work = protocol.work_subject(ns, agent_id)
        work = protocol.STREAM_WORK
        status = protocol.STREAM_STATUS
        return {
            "publish": {
                "allow": [
                    *(protocol.hub_agent_subject(agent_id, v) for v in protocol.AGENT_VERBS),
                    protocol.task_status(agent_id, "*"),
                    # Answers to tasks and control requests: from hubs, on the reply subjects
                    # of its own namespace there (hub/_reply_boxes.py: another namespace's
                    # are read on subscriptions of their own, which its flood must not
                    # reach), and (direct mode) from callers of its own namespace; never into
                    # another agent's inbox, nor a hub's own requests' replies.
                    hub_replies(ns),
                    inbox_prefix("caller", ns) + ".>",
                    # At start, whether another process serves its id (agent/_one_process.py):
                    # a ping on its own ctl subject, answered into its own inbox.
                    protocol.agent_ctl(agent_id),
                    inbox,
                    # Durable workflow steps: its own consumer on REACH_WORK, nothing else.
                    f"{_API}.INFO",
                    f"{_API}.STREAM.INFO.{work}",
                    f"{_API}.STREAM.INFO.{status}",
                    # Created by name with its filter in the subject: its own work subject
                    # only (a filter of its choosing would take other agents' steps).
                    f"{_API}.CONSUMER.CREATE.{work}.{durable}.{own_work}",
                    f"{_API}.CONSUMER.INFO.{work}.{durable}",
                    f"{_API}.CONSUMER.MSG.NEXT.{work}.{durable}",
                    f"$JS.ACK.{work}.{durable}.>",
                    # The task records of its namespace (read: the fence) ...
                    f"{_API}.STREAM.INFO.{_KV_TASKS_STREAM}",
                    f"{_API}.DIRECT.GET.{_KV_TASKS_STREAM}.$KV.{protocol.KV_TASKS}.{ns}.>",
                    # ... and the last status of each of its own tasks (its final statuses,
                    # read back after a restart: the idempotency table).
                    # Under its own consumer name only: no other agent can re-point or delete
                    # it (a name the permission did not fix could be re-created by anyone
                    # allowed to create consumers here who learned it).
                    f"{_API}.CONSUMER.CREATE.{status}.{status_name}.{own_status}",
                    f"{_API}.CONSUMER.INFO.{status}.{status_name}",
                    f"{_API}.CONSUMER.DELETE.{status}.{status_name}",
                    "$JS.FC.>",
                ]
            },
            "subscribe": {
                "allow": [f"reach.agent.{agent_id}.>", inbox],
            },
        }
    if role == "caller":
        ns = name
        return {
            "publish": {
                "allow": [
                    *(
                        protocol.hub_subject(ns, v)
                        for v in (
                            "route",
                            "route_batch",
                            "agents",
                            "workflow",
                            "workflows",
                            "cancel",
                        )
                    ),
                    protocol.hub_subject(ns, "report"),
                    # Direct mode: the hub's decision names the agent; the caller sends to it.
                    protocol.agent_task(f"{ns}.*.*"),
                    protocol.agent_batch(f"{ns}.*.*"),
                    protocol.wf_submit(ns),
                    # Whether the stream it submits to exists, when a submission meets none:
                    # refused, no hub ever having run looked like an election (retried 15 s).
                    f"{_API}.STREAM.INFO.{protocol.STREAM_WF}",
                    f"{_API}.STREAM.INFO.{_KV_WORKFLOWS_STREAM}",
                    f"{_API}.DIRECT.GET.{_KV_WORKFLOWS_STREAM}.$KV.{protocol.KV_WORKFLOWS}.{ns}.>",
                    f"{_API}.STREAM.INFO.{protocol.STREAM_WF_EVENTS}",
                    f"{_API}.CONSUMER.CREATE.{protocol.STREAM_WF_EVENTS}.*.reach.wf.{ns}.>",
                    f"{_API}.CONSUMER.DELETE.{protocol.STREAM_WF_EVENTS}.*",
                    "$JS.FC.>",
                ]
            },
            "subscribe": {"allow": [f"reach.wf.{ns}.>", inbox]},
        }
    if role == "operator":
        audit = protocol.STREAM_AUDIT
        return {
            "publish": {
                "allow": [
                    *(
                        protocol.hub_subject("*", v)
                        for v in ("admin", "agents", "workflow", "workflows", "cancel")
                    ),
                    *(protocol.hub_subject("*", v) for v in ("route", "route_batch")),
                    # NATS micro discovery of the hubs and their endpoints.
                    "$SRV.>",
                    protocol.micro_subject("*", "agents"),
                    # ``reach-mesh doctor``: account, stream and queue info (no message).
                    f"{_API}.INFO",
                    f"{_API}.STREAM.INFO.*",
                    f"{_API}.CONSUMER.INFO.{protocol.STREAM_WF}.{protocol.CONSUMER_HUBS}",
                    f"{_API}.CONSUMER.CREATE.{audit}",
                    f"{_API}.CONSUMER.CREATE.{audit}.>",
                    f"{_API}.CONSUMER.DELETE.{audit}.*",
                    "$JS.FC.>",
                ]
            },
            "subscribe": {"allow": [inbox]},
        }
    raise BadRequestError(f"unknown role {role!r}")


def settings_for(identity: Identity, seed_file: Path, nats_url: str | None) -> dict[str, Any]:
    """reach-mesh settings (YAML) for an identity: where its seed is, its inbox prefix."""
    out: dict[str, Any] = {
        "nats_nkey_seed": str(seed_file),
        "nats_inbox_prefix": identity.inbox_prefix,
    }
    if nats_url:
        out["nats_url"] = nats_url
    if identity.role == "caller":
        out["namespace"] = identity.name
    elif identity.role == "agent":
        out["namespace"] = protocol.namespace_of(identity.name)
    return out


def new_seed() -> tuple[bytes, str]:
    """A fresh user nkey: (seed, public key)."""
    import nkeys  # the nats-py dependency that signs the server's nonce with the seed

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    kp = nkeys.from_seed(bytearray(seed))
    public = kp.public_key.decode()
    kp.wipe()
    return bytes(seed), public


class AuthDir:
    """An auth directory: issue identities, write the server's auth file."""

    def __init__(self, path: str | os.PathLike[str], *, nats_url: str | None = None) -> None:
        self.path = Path(path).resolve()
        self.nats_url = nats_url

    @property
    def auth_conf(self) -> Path:
        return self.path / _AUTH_CONF

    @property
    def nats_conf(self) -> Path:
        return self.path / _NATS_CONF

    def seed_file(self, role: str, name: str) -> Path:
        return self.path / f"{role}.{name}.nk"

    def settings_file(self, role: str, name: str) -> Path:
        return self.path / f"{role}.{name}.yaml"

    def settings(self, role: str, name: str, **overrides: Any) -> MeshSettings:
        """The ``MeshSettings`` of an issued identity (its YAML file), with ``overrides``."""
        f = self.settings_file(role, name)
        if not f.exists():
            raise BadRequestError(f"no identity {role} {name!r} in {self.path}")
        return load_settings(f, **overrides)

    def identities(self) -> list[Identity]:
        f = self.path / _IDENTITIES
        if not f.exists():
            return []
        try:
            raw = json.loads(f.read_text())
            return [Identity(i["role"], i["name"], i["public_key"]) for i in raw["identities"]]
        except (ValueError, KeyError, TypeError) as err:
            raise BadRequestError(f"{f} is not a reach-mesh identities file: {err}") from err

    def init(
        self,
        *,
        hub: str = "main",
        operator: str = "admin",
        namespace: str = protocol.DEFAULT_NAMESPACE,
        host: str = "0.0.0.0",
        port: int = 4222,
        store_dir: str | None = None,
    ) -> list[Identity]:
        """A new directory with a hub, an operator and a caller for ``namespace``."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._locked():
            if (self.path / _IDENTITIES).exists():
                raise BadRequestError(f"{self.path} already holds identities: use auth add-*")
            return self._init(hub, operator, namespace, host, port, store_dir)

    def _init(
        self, hub: str, operator: str, ns: str, host: str, port: int, store_dir: str | None
    ) -> list[Identity]:
        out = [self._add("hub", hub), self._add("operator", operator), self._add("caller", ns)]
        _replace_file(
            self.nats_conf,
            server_config(
                host=host,
                port=port,
                store_dir=store_dir or str(self.path / "jetstream"),
                include=_AUTH_CONF,
            ),
        )
        return out

    def rewrite(self) -> None:
        """Write auth.conf again from the identities issued: the permissions of this version
        of reach-mesh (they are computed from role and name, never stored). Nothing is written
        without identities.json (an auth.conf written by hand, or elsewhere, stays)."""
        if not (self.path / _IDENTITIES).exists():
            return
        with self._locked():
            self._rewrite()

    def _rewrite(self) -> None:
        known = self.identities()
        if known:
            _replace_file(self.auth_conf, auth_config(known))

    def add(self, role: str, name: str) -> Identity:
        """Issue (or return the existing) identity ``role``/``name`` and rewrite auth.conf."""
        validate_identity(role, name)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._locked():
            return self._add(role, name)

    def revoke(self, role: str, name: str) -> Identity:
        """Take the identity ``role``/``name`` out: from identities.json and auth.conf, and
        its seed and settings files from this directory. The servers refuse it from their
        next reload on, and cut off the connections that use it then. A new ``add`` of the
        same role and name issues a new seed: that is how a credential is rotated."""
        validate_identity(role, name)
        with self._locked():
            known = self.identities()
            gone = [i for i in known if i.role == role and i.name == name]
            if not gone:
                issued = ", ".join(f"{i.role} {i.name}" for i in known) or "none"
                raise BadRequestError(
                    f"no identity {role} {name!r} issued in {self.path} (issued: {issued})"
                )
            known = [i for i in known if i not in gone]
            # auth.conf first: once it names the key no more, the identity is out at the next
            # reload, whatever happens to the files after it.
            _replace_file(self.auth_conf, auth_config(known))
            self._write_identities(known)
            for f in (self.seed_file(role, name), self.settings_file(role, name)):
                f.unlink(missing_ok=True)
            return gone[0]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer of the directory at a time (``reach-mesh auth`` commands run at once, by
        a provisioning script, say): each reads identities.json, adds to it and writes it and
        auth.conf again — run together, an identity was lost from both (its seed file written:
        refused by the server, and its add again refused as a seed that is no identity's)."""
        fd = os.open(
            self.path / _LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (the lock goes with it)

    def _add(self, role: str, name: str) -> Identity:
        validate_identity(role, name)
        known = self.identities()
        for ident in known:
            if ident.role == role and ident.name == name:
                self._rewrite()
                return ident
        seed, public = new_seed()
        seed_file = self.seed_file(role, name)
        try:
            # A new file only, never through a link: a file planted where the seed goes would
            # keep its owner and mode (and a link would send the seed elsewhere).
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(seed_file, flags, 0o600)
        except FileExistsError as err:
            raise BadRequestError(
                f"{seed_file} exists but is no issued identity's seed: remove it, then retry"
            ) from err
        with os.fdopen(fd, "wb") as f:
            f.write(seed + b"\n")
            f.flush()
            os.fsync(f.fileno())  # on disk before auth.conf names its public key
        ident = Identity(role, name, public)
        known.append(ident)
        self._write_identities(known)
        import yaml

        _replace_file(
            self.settings_file(role, name),
            yaml.safe_dump(settings_for(ident, seed_file, self.nats_url), sort_keys=False),
        )
        _replace_file(self.auth_conf, auth_config(known))
        return ident

    def _write_identities(self, known: list[Identity]) -> None:
        body = {
            "account": ACCOUNT,
            "identities": [
                {"role": i.role, "name": i.name, "public_key": i.public_key} for i in known
            ],
        }
        _replace_file(self.path / _IDENTITIES, json.dumps(body, indent=2) + "\n")


def _replace_file(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file in the same directory, synced, then
    renamed over it. A running nats-server reloaded meanwhile (``up --secure`` polls auth.conf,
    an operator's kill -HUP) reads the old file or the new one, never half of one, which would
    refuse every identity. The file keeps its mode (0644 when new: no secrets in these files)
    and, as far as this process may give them, its owner and group (an auth.conf of group
    ``nats``, mode 0640, read by a nats-server running as that user: replaced by a file of
    the writer's own group, the server's next reload could not read it); a link is written
    through to the file it names."""
    path = path.resolve()
    mode = 0o644
    owner: tuple[int, int] | None = None
    with contextlib.suppress(FileNotFoundError):
        st = path.stat()
        mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
            f.flush()
            if owner is not None:
                _keep_owner(f.fileno(), *owner)
            os.fchmod(f.fileno(), mode)  # (after the owner: a chown may clear mode bits)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def _keep_owner(fd: int, uid: int, gid: int) -> None:
    """Give the file ``fd`` the owner and group of the file it replaces: both as root, the
    group alone as its owner (one of the user's groups), else nothing (it stays the writer's)."""
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) == (uid, gid):
        return
    try:
        os.fchown(fd, uid, gid)
    except PermissionError:
        with contextlib.suppress(PermissionError):
            os.fchown(fd, -1, gid)


def auth_config(identities: list[Identity]) -> str:
    """The ``accounts`` block of nats-server's config for these identities."""
    users = []
    for ident in identities:
        perms = json.dumps(permissions(ident.role, ident.name), indent=2)
        perms = perms.replace("\n", "\n      ")
        users.append(
            f"    # {ident.role} {ident.name}\n"
            f'    {{ nkey: "{ident.public_key}", permissions: {perms} }}'
        )
    return (
        "# Generated by `reach-mesh auth` from identities.json: edit that, not this.\n"
        "# Reload each running server after a change: kill -HUP <pid>, or nats-server\n"
        "# --signal reload=<pid> (without =<pid> it refuses when several servers run).\n"
        "accounts {\n"
        f"  {ACCOUNT}: {{\n"
        "    jetstream: enabled\n"
        "    users: [\n" + ",\n".join(users) + "\n    ]\n  }\n}\n"
    )


def server_config(*, port: int, store_dir: str, include: str, host: str = "0.0.0.0") -> str:
    """A standalone nats-server config for a secure mesh (docker, ``nats-server -c``)."""
    return (
        f"host: {host}\n"
        f"port: {port}\n"
        "max_payload: 8MB\n"
        "jetstream {\n"
        f'  store_dir: "{store_dir}"\n'
        "}\n"
        f'include "{include}"\n'
    )
