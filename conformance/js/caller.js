// A reach-mesh caller library in JavaScript, written from docs/protocol.md and
// docs/protocol-workflows.md only: routing (proxy and direct mode), typed errors, trace
// context, workflows (submit, wait on .done or the record, spec_digest, events, view, cancel).
'use strict';
const crypto = require('crypto');
const fs = require('fs');
const { connect, headers: natsHeaders, StringCodec, ErrorCode, nkeyAuthenticator } = require('nats');

const sc = StringCodec();

class ReachError extends Error {
  constructor(code, message, details) {
    super(`${code}: ${message}`);
    this.code = code;
    this.details = details || {};
  }
}

// protocol.md, Conventions: known codes; unknown codes are read as REACH_ERROR.
const KNOWN_CODES = new Set([
  'REACH_BAD_REQUEST', 'REACH_BAD_AGENT_ID', 'REACH_IDENTITY_MISMATCH', 'REACH_BAD_CAPABILITY',
  'REACH_BAD_SELECTOR', 'REACH_BAD_LEASE', 'REACH_PAYLOAD_TOO_LARGE', 'REACH_BAD_WORKFLOW',
  'REACH_UNKNOWN_AGENT', 'REACH_UNKNOWN_WORKFLOW', 'REACH_CANCELLED', 'REACH_WORKFLOW_CANCELLED',
  'REACH_NO_MATCH', 'REACH_THROTTLED', 'REACH_AGENT_BUSY', 'REACH_NO_HANDLER',
  'REACH_HANDLER_FAILED', 'REACH_STALE_ATTEMPT', 'REACH_TIMEOUT', 'REACH_UNAVAILABLE',
  'REACH_WORKFLOW_CONFLICT', 'REACH_TASK_ID_CONFLICT', 'REACH_INTERNAL',
  'REACH_UNKNOWN_NAMESPACE', 'REACH_NOT_PERMITTED', 'REACH_UNAUTHORIZED',
  'REACH_FORBIDDEN_HOST', 'REACH_FORBIDDEN_ORIGIN', 'REACH_UNSUPPORTED_MEDIA_TYPE',
]);

// protocol.md, "The error-body rule": an answer is an error iff it is an object whose only
// member is `error`, holding an object.
function isErrorBody(obj) {
  if (obj === null || typeof obj !== 'object' || Array.isArray(obj)) return false;
  const keys = Object.keys(obj);
  return keys.length === 1 && keys[0] === 'error' && obj.error !== null &&
    typeof obj.error === 'object' && !Array.isArray(obj.error);
}

function toError(body) {
  const e = body.error;
  let code = typeof e.code === 'string' ? e.code.slice(0, 64) : 'REACH_ERROR';
  if (!KNOWN_CODES.has(code)) code = 'REACH_ERROR';
  return new ReachError(code, String(e.message ?? ''), e.details);
}

// W3C trace context (protocol.md, Conventions, Headers)
function newTraceparent() {
  const traceId = crypto.randomBytes(16).toString('hex');
  const spanId = crypto.randomBytes(8).toString('hex');
  return `00-${traceId}-${spanId}-01`;
}
function traceIdOf(tp) {
  const m = /^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})/.exec(tp || '');
  return m ? m[2] : null;
}

const ID_TOKEN = /^[a-z0-9][a-z0-9_-]*$/;
function checkNamespace(ns) {
  if (typeof ns !== 'string' || ns.length > 64 || !ID_TOKEN.test(ns)) {
    throw new ReachError('REACH_BAD_REQUEST', `bad namespace ${ns}`, { field: 'namespace' });
  }
}
function newTaskId() { return crypto.randomBytes(16).toString('hex'); }

class ReachClient {
  constructor(nc, namespace) {
    checkNamespace(namespace);
    this.nc = nc;
    this.ns = namespace;
    this.js = nc.jetstream();
  }

  static async connect(url, namespace, { seedFile, inboxPrefix } = {}) {
    // inbox prefix must be `_INBOX` or start with `_INBOX.` (nats.js default: `_INBOX`);
    // secure mode: the identity's own prefix (`_INBOX.caller.<ns>`) and its nkey seed.
    const opts = { servers: url, inboxPrefix: inboxPrefix || '_INBOX' };
    if (seedFile) {
      const seed = fs.readFileSync(seedFile, 'utf8').trim();
      opts.authenticator = nkeyAuthenticator(new TextEncoder().encode(seed));
    }
    const nc = await connect(opts);
    return new ReachClient(nc, namespace);
  }

  close() { return this.nc.drain(); }

  // A request-reply to a hub subject; returns the parsed success body, throws ReachError.
  async hubRequest(subject, body, { timeoutMs = 10000, traceparent, raw = false } = {}) {
    const h = natsHeaders();
    const tp = traceparent || newTraceparent();
    h.set('traceparent', tp);
    const data = raw ? (typeof body === 'string' ? sc.encode(body) : body) : sc.encode(JSON.stringify(body));
    let msg;
    try {
      msg = await this.nc.request(subject, data, { timeout: timeoutMs, headers: h });
    } catch (err) {
      if (err.code === ErrorCode.NoResponders) throw new ReachError('REACH_UNAVAILABLE', 'no hub answered');
      if (err.code === ErrorCode.Timeout) throw new ReachError('REACH_TIMEOUT', 'no answer in time');
      throw err;
    }
    const text = sc.decode(msg.data);
    let obj;
    try { obj = JSON.parse(text); } catch (e) {
      throw new ReachError('REACH_ERROR', `unparsable reply: ${text.slice(0, 200)}`);
    }
    if (isErrorBody(obj)) throw toError(obj);
    return { body: obj, headers: msg.headers, traceparent: tp };
  }

  // protocol.md "RouteRequest"; returns {reply, traceparent, trace_id}
  async route(req, { traceparent, timeoutMs } = {}) {
    const r = { ...req };
    if (r.task_id === undefined) r.task_id = newTaskId();
    const tp = traceparent || newTraceparent();
    // The hub's own timeout is `timeout` (default 30 s) for the whole task; wait a bit more.
    const wait = timeoutMs || ((r.timeout ?? 30) * 1000 + 2000);
    const { body } = await this.hubRequest(`reach.hub.${this.ns}.route`, r, { timeoutMs: wait, traceparent: tp });
    return { reply: body, traceparent: tp, trace_id: traceIdOf(tp), task_id: r.task_id };
  }

  // Direct mode: the hub decides, the caller sends the TaskEnvelope itself.
  async routeDirect(req, { traceparent } = {}) {
    const tp = traceparent || newTraceparent();
    const r = { ...req, mode: 'direct' };
    if (r.task_id === undefined) r.task_id = newTaskId();
    const { body } = await this.hubRequest(`reach.hub.${this.ns}.route`, r, { traceparent: tp });
    const env = {
      task_id: r.task_id, attempt: 1,
      capability: r.capability ?? selectorCapability(r.selector) ?? null,
      payload: r.payload ?? null, namespace: this.ns, timeout: r.timeout ?? 30,
      workflow_id: null, step: null, track: false,
    };
    const h = natsHeaders();
    h.set('traceparent', tp);
    const msg = await this.nc.request(body.subject, sc.encode(JSON.stringify(env)),
      { timeout: (env.timeout + 2) * 1000, headers: h });
    const obj = JSON.parse(sc.decode(msg.data));
    if (isErrorBody(obj)) throw toError(obj);
    return { decision: body, reply: obj, replyHeaders: msg.headers, traceparent: tp };
  }
}

// protocol.md "Which capability an envelope carries": first cap= term. Minimal: tokens.
function selectorCapability(sel) {
  if (!sel) return null;
  const m = /(?:^|\s)cap\s*=\s*([a-z0-9][a-z0-9_-]*:[a-z0-9][a-z0-9_-]*:v[0-9]+)/.exec(sel);
  return m ? m[1] : null;
}

// ---------------------------------------------------------------- workflows
// protocol-workflows.md, Identifiers
const WF_ID = /^[A-Za-z0-9_-]{1,48}$/;
function newWorkflowId() { return crypto.randomBytes(16).toString('hex'); } // 128 bits
function nonce() { return crypto.randomBytes(16).toString('hex'); }          // 32 hex, no dots

// Numbers as the hub writes them when it computes the digest (pydantic-core, not Python's
// json): a float in shortest round-trip form, exponent form below 1e-5 and from 1e16
// ("2e-6", "1e+16"), integral floats with ".0". JS writes 0.000001..0.00001 in decimal and
// integral numbers without ".0".
function floatText(x) {
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-5 || a >= 1e16)) return x.toExponential();
  if (Number.isInteger(x)) return x.toFixed(1);
  return JSON.stringify(x);
}
// a number a float field holds (timeouts, retry times)
function pyFloat(x) { return floatText(x); }
// compact JSON of a payload as the hub re-writes it: a JSON integer stays an integer, any
// other number is a float (JS sends integral values as integers, so only fractions count).
function compact(v) {
  if (typeof v === 'number') {
    if (!Number.isFinite(v)) return 'null';
    if (Number.isInteger(v)) return JSON.stringify(v);
    return floatText(v);
  }
  if (v === null || typeof v !== 'object') return JSON.stringify(v);
  if (typeof v.toJSON === 'function') return compact(v.toJSON());
  if (Array.isArray(v)) return `[${v.map((x) => (x === undefined || typeof x === 'function' ? 'null' : compact(x))).join(',')}]`;
  const parts = [];
  for (const k of Object.keys(v)) {
    const x = v[k];
    if (x === undefined || typeof x === 'function') continue;
    parts.push(`${JSON.stringify(k)}:${compact(x)}`);
  }
  return `{${parts.join(',')}}`;
}

const STEP_KEYS = ['agent_id', 'capability', 'selector', 'payload', 'timeout', 'retry', 'task_id', 'strategy'];
const RETRY_KEYS = ['retries', 'fast_attempts', 'backoff_base', 'backoff_cap', 'pending_interval', 'ttl', 'deliver_timeout', 'silence_timeout'];
const RETRY_INT = new Set(['retries', 'fast_attempts']);

// protocol-workflows.md, "Submitting and waiting" step 3: spec_digest
function specDigest(spec) {
  const parts = [];
  parts.push(`"kind":${compact(spec.kind)}`);
  const steps = spec.steps.map((s) => {
    const f = [];
    for (const k of STEP_KEYS) {
      let v = s[k];
      if (k === 'timeout' && (v === undefined || v === null)) v = 30.0;
      if (k === 'retry' && (v === undefined || v === null)) v = {};
      if (v === undefined || v === null) continue;
      if (k === 'timeout') f.push(`"timeout":${pyFloat(v)}`);
      else if (k === 'retry') {
        const r = [];
        for (const rk of RETRY_KEYS) {
          const rv = v[rk];
          if (rv === undefined || rv === null) continue;
          r.push(`${compact(rk)}:${RETRY_INT.has(rk) ? compact(rv) : pyFloat(rv)}`);
        }
        f.push(`"retry":{${r.join(',')}}`);
      } else f.push(`${compact(k)}:${compact(v)}`);
    }
    return `{${f.join(',')}}`;
  });
  parts.push(`"steps":[${steps.join(',')}]`);
  parts.push(`"policy":${compact(spec.policy ?? 'all')}`);
  parts.push(`"namespace":${compact(spec.namespace)}`);
  const text = `{${parts.join(',')}}`;
  return { digest: crypto.createHash('sha256').update(Buffer.from(text, 'utf8')).digest('hex').slice(0, 32), text };
}

const FINAL_WF = new Set(['SUCCEEDED', 'FAILED', 'TIMEOUT']);

Object.assign(ReachClient.prototype, {
  // KV read by direct get (protocol.md "JetStream resources")
  async kvGet(bucket, key, timeoutMs = 2000) {
    const subj = `$JS.API.DIRECT.GET.KV_${bucket}.$KV.${bucket}.${key}`;
    let msg;
    try { msg = await this.nc.request(subj, new Uint8Array(0), { timeout: timeoutMs }); } catch (e) {
      if (e.code === ErrorCode.NoResponders) return { missing: true, why: 'no responders' };
      throw e;
    }
    const code = msg.headers && msg.headers.code;
    if (code && code >= 300) return { missing: true, why: `status ${code}` };
    const op = msg.headers && msg.headers.get('KV-Operation');
    if (op === 'DEL' || op === 'PURGE') return { missing: true, why: op };
    if (!msg.data || msg.data.length === 0) return { missing: true, why: 'empty' };
    return { value: JSON.parse(sc.decode(msg.data)), headers: msg.headers };
  },

  async workflowRecord(wfId) { return this.kvGet('reach_workflows', `${this.ns}.${wfId}`); },

  // Submit a WorkflowSpec; returns a handle with wait(), events(), ...
  async submitWorkflow(kind, steps, { policy, timeout, workflowId, traceparent } = {}) {
    const wfId = workflowId || newWorkflowId();
    if (!WF_ID.test(wfId)) throw new ReachError('REACH_BAD_WORKFLOW', 'bad workflow_id', { field: 'workflow_id' });
    const spec = { workflow_id: wfId, kind, policy: policy ?? 'all', namespace: this.ns, steps };
    if (timeout !== undefined) spec.timeout = timeout;
    const tp = traceparent || newTraceparent();
    const doneSubject = `reach.wf.${this.ns}.${wfId}.done`;
    // 1. subscribe to .done before submitting
    let resolveDone; const donePromise = new Promise((r) => { resolveDone = r; });
    const doneHeaders = [];
    const sub = this.nc.subscribe(doneSubject, {
      callback: (err, m) => {
        if (err) return;
        if (m.subject !== doneSubject) return; // take only that subject
        let r; try { r = JSON.parse(sc.decode(m.data)); } catch { return; }
        if (!r || r.workflow_id !== wfId) return;
        doneHeaders.push(m.headers);
        resolveDone(r);
      },
    });
    await this.nc.flush();
    // 2. JetStream publish with Nats-Msg-Id <ns>.<workflow_id>.<nonce>
    const h = natsHeaders();
    h.set('traceparent', tp);
    const msgID = `${this.ns}.${wfId}.${nonce()}`;
    let ack;
    for (let i = 0; ; i++) {
      try {
        ack = await this.js.publish(`reach.wf.${this.ns}.submit`, sc.encode(JSON.stringify(spec)),
          { msgID, expect: { streamName: 'REACH_WF' }, headers: h, timeout: 5000 });
        break;
      } catch (e) {
        if (i >= 10) { sub.unsubscribe(); throw new ReachError('REACH_UNAVAILABLE', `submit: ${e.message}`); }
        await new Promise((r) => setTimeout(r, 500));
      }
    }
    const { digest } = specDigest(spec);
    return { id: wfId, spec, digest, ack, traceparent: tp, trace_id: traceIdOf(tp), donePromise, sub, doneHeaders, msgID };
  },

  // 4. wait for .done; read the record now and then (every 5 s) and at the end of the wait.
  async waitWorkflow(handle, timeoutMs = 60000) {
    const deadline = Date.now() + timeoutMs;
    let result = null; let source = null;
    while (!result && Date.now() < deadline) {
      let timer;
      const tick = new Promise((r) => { timer = setTimeout(() => r(null), Math.min(5000, deadline - Date.now())); });
      const r = await Promise.race([handle.donePromise, tick]);
      clearTimeout(timer); // a pending timer would keep the process alive
      if (r) { result = r; source = 'done'; break; }
      const rec = await this.workflowRecord(handle.id).catch(() => ({ missing: true }));
      if (!rec.missing && FINAL_WF.has(rec.value.state) && rec.value.result) { result = rec.value.result; source = 'record'; }
    }
    handle.sub.unsubscribe();
    if (!result) throw new ReachError('REACH_TIMEOUT', `workflow ${handle.id}: no result in time`);
    if (result.spec_digest && result.spec_digest !== handle.digest) {
      throw new ReachError('REACH_WORKFLOW_CONFLICT', `spec_digest ${result.spec_digest} != ours ${handle.digest}`, { result });
    }
    return { result, source };
  },

  // 5. events: ordered consumer on REACH_WF_EVENTS filtered on .event; after the result,
  // read as many as STREAM.INFO subjects_filter says the stream holds.
  async workflowEvents(wfId, timeoutMs = 5000) {
    const subj = `reach.wf.${this.ns}.${wfId}.event`;
    const info = await this.nc.request('$JS.API.STREAM.INFO.REACH_WF_EVENTS',
      sc.encode(JSON.stringify({ subjects_filter: subj })), { timeout: 2000 });
    const si = JSON.parse(sc.decode(info.data));
    if (si.error) throw new ReachError('REACH_UNAVAILABLE', `stream info: ${JSON.stringify(si.error)}`);
    const count = (si.state && si.state.subjects && si.state.subjects[subj]) || 0;
    const events = []; const hdrs = [];
    if (count === 0) return { events, count, headers: hdrs };
    // A *named* push consumer, filter in the API subject, delivering to our own inbox: the only
    // shape a caller identity may create in secure mode (protocol.md, permissions per role):
    // no $JS.API.CONSUMER.MSG.NEXT (pull) and no un-named CONSUMER.CREATE are allowed.
    const name = `ev${crypto.randomBytes(8).toString('hex')}`;
    const deliver = `${this.nc.options.inboxPrefix}.${name}`;
    let done; const finished = new Promise((r) => { done = r; });
    const sub = this.nc.subscribe(deliver, {
      callback: (err, m) => {
        if (err) return;
        if (m.headers && m.headers.code === 100) { // idle heartbeat / flow control
          if (m.reply) m.respond();
          return;
        }
        if (m.subject !== subj) return; // stored subject; count only the event subject
        if (!m.data || m.data.length === 0) return;
        events.push(JSON.parse(sc.decode(m.data)));
        hdrs.push(m.headers);
        if (events.length >= count) done();
      },
    });
    await this.nc.flush();
    const cfg = {
      stream_name: 'REACH_WF_EVENTS',
      config: {
        name, deliver_subject: deliver, filter_subject: subj, deliver_policy: 'all',
        ack_policy: 'none', replay_policy: 'instant', flow_control: true,
        idle_heartbeat: 1e9, inactive_threshold: 30e9, mem_storage: true, num_replicas: 1,
      },
    };
    const cr = await this.nc.request(`$JS.API.CONSUMER.CREATE.REACH_WF_EVENTS.${name}.${subj}`,
      sc.encode(JSON.stringify(cfg)), { timeout: 2000 });
    const crj = JSON.parse(sc.decode(cr.data));
    if (crj.error) { sub.unsubscribe(); throw new ReachError('REACH_UNAVAILABLE', `consumer create: ${JSON.stringify(crj.error)}`); }
    let timer;
    await Promise.race([finished, new Promise((r) => { timer = setTimeout(r, timeoutMs); })]);
    clearTimeout(timer);
    sub.unsubscribe();
    await this.nc.request(`$JS.API.CONSUMER.DELETE.REACH_WF_EVENTS.${name}`, new Uint8Array(0), { timeout: 2000 }).catch(() => {});
    return { events, count, headers: hdrs };
  },

  async cancelWorkflow(wfId, { reason, timeoutMs = 10000, beforeStart = false } = {}) {
    const cancelId = crypto.randomBytes(8).toString('hex');
    const deadline = Date.now() + timeoutMs;
    let last;
    while (Date.now() < deadline) {
      const left = (deadline - Date.now()) / 1000;
      const body = { workflow_id: wfId, within_s: Math.max(0.1, Math.min(3, left - 0.2)), cancel_id: cancelId };
      if (reason) body.reason = reason;
      if (beforeStart) body.before_start = true;
      try {
        const { body: r } = await this.hubRequest(`reach.hub.${this.ns}.cancel`, body, { timeoutMs: 4000 });
        last = r;
        if (r.final) return r;
        if (r.state === 'PENDING' && !r.owner) return r;
      } catch (e) {
        if (!['REACH_UNAVAILABLE', 'REACH_UNKNOWN_WORKFLOW', 'REACH_TIMEOUT', 'REACH_THROTTLED'].includes(e.code)) throw e;
        last = e;
      }
      await new Promise((r) => setTimeout(r, 200));
    }
    if (last instanceof Error) throw last;
    return last;
  },

  async workflowView(wfId) {
    const { body } = await this.hubRequest(`reach.hub.${this.ns}.workflow`, { workflow_id: wfId });
    return body;
  },
});

module.exports = {
  ReachClient, ReachError, isErrorBody, newTraceparent, traceIdOf, newTaskId, newWorkflowId,
  specDigest, sc,
};
