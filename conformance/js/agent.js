// A reach-mesh agent in JavaScript, written from docs/protocol.md and
// docs/protocol-workflows.md only: registration and heartbeats, request-reply tasks, ctl
// (ping, task_state with fence promises, cancel), durable workflow steps (work consumer, fence
// read, status events, final status stored in REACH_STATUS), idempotency rebuilt from
// REACH_STATUS at start, drain and unregister on SIGTERM/SIGINT.
//
// Configuration (environment):
//   REACH_NATS_URL           nats://127.0.0.1:4222
//   REACH_AGENT_ID           <namespace>.<service>.<instance> (required)
//   REACH_AGENT_CAPS         comma-separated: serve only these of the handlers below
//   REACH_NKEY_SEED_FILE     secure mode: the agent identity's nkey seed
//   REACH_INBOX_PREFIX       secure mode: the identity's inbox prefix (_INBOX.agent.<agent_id>)
//   REACH_HEARTBEAT_INTERVAL seconds (2), REACH_LEASE_TIMEOUT seconds (6)
//   REACH_WORK_ACK_WAIT      the work consumer's ack_wait, seconds (30)
//   REACH_RUNNING_INTERVAL   seconds between RUNNING statuses of a running step (3)
// Prints "serving <agent_id> capabilities=..." on stdout once registered; logs go to stderr.
// Exit codes: 0 after a clean shutdown, 1 on a fatal error, 2 on bad configuration.
'use strict';
const crypto = require('crypto');
const fs = require('fs');
const {
  connect, headers: mkHeaders, AckPolicy, DeliverPolicy, RetentionPolicy,
  ErrorCode, nanos, nkeyAuthenticator,
} = require('nats');

function log(...a) { console.error(new Date().toISOString(), `[js-agent ${AGENT_ID}]`, ...a); }
function configError(msg) { console.error(`agent.js: ${msg}`); process.exit(2); }
function seconds(name, dflt) {
  const v = process.env[name] === undefined ? dflt : Number(process.env[name]);
  if (!(Number.isFinite(v) && v > 0)) configError(`${name} must be a positive number of seconds`);
  return v;
}

const NATS_URL = process.env.REACH_NATS_URL || 'nats://127.0.0.1:4222';
const AGENT_ID = process.env.REACH_AGENT_ID || '';
if (!/^[a-z0-9][a-z0-9_-]*\.[a-z0-9][a-z0-9_-]*\.[a-z0-9][a-z0-9_-]*$/.test(AGENT_ID)) {
  configError(`REACH_AGENT_ID must be <namespace>.<service>.<instance>, got "${AGENT_ID}"`);
}
const [NS, SERVICE, INSTANCE] = AGENT_ID.split('.');
const HB_INTERVAL = seconds('REACH_HEARTBEAT_INTERVAL', 2.0);
const LEASE = seconds('REACH_LEASE_TIMEOUT', 6.0);
const WORK_ACK_WAIT_S = seconds('REACH_WORK_ACK_WAIT', 30);
const RUNNING_INTERVAL_S = seconds('REACH_RUNNING_INTERVAL', 3);
const MAX_CONCURRENCY = 8;
const MAX_QUEUE = 0; // no queue: a task beyond max_concurrency is refused REACH_AGENT_BUSY
const CAPACITY = MAX_CONCURRENCY + MAX_QUEUE;
const WORKFLOW_RETENTION_S = 86400;
const SESSION = crypto.randomBytes(16).toString('hex');
const NONCE_KEY = crypto.randomBytes(32);
const te = new TextEncoder();
const td = new TextDecoder();

// REACH_AGENT_NULLS=1: an encoder that writes null for the numbers and flags it has no value
// for, as a careless client might; readers take such a null as the field left out.
const NULLS = process.env.REACH_AGENT_NULLS === '1';
const NULLED = ['duration_ms', 'queued_ms', 'cached'];
function nulled(o) {
  if (!o || typeof o !== 'object' || Array.isArray(o)) return o;
  const c = { ...o };
  for (const k of NULLED) if (k in c) c[k] = null;
  return c;
}
const enc = (o) => te.encode(JSON.stringify(NULLS ? nulled(o) : o));
function dec(data) { try { return JSON.parse(td.decode(data)); } catch (e) { return undefined; } }
const now = () => performance.now();

// ---------------------------------------------------------------- handlers
class HandlerError extends Error {
  constructor(code, message, details) { super(message); this.code = code; this.details = details; }
}
const HANDLERS = {
  'text:upper:v1': async (payload) => {
    if (!payload || typeof payload.text !== 'string') {
      throw new HandlerError('REACH_BAD_REQUEST', 'payload.text must be a string', { retryable: false });
    }
    return { text: payload.text.toUpperCase(), by: AGENT_ID, lang: 'js' };
  },
  'math:fail:v1': async (payload) => {
    throw new HandlerError('REACH_HANDLER_FAILED', 'js handler refused: ' + JSON.stringify(payload),
      { retryable: false, from: 'node' });
  },
  'test:sleep:v1': async (payload) => {
    await new Promise((r) => setTimeout(r, (payload && payload.ms) || 1000));
    return { slept: (payload && payload.ms) || 1000 };
  },
  'wf:flaky:v1': async (payload, env) => {
    if (env.attempt < 2) throw new HandlerError('REACH_HANDLER_FAILED', `flaky: attempt ${env.attempt} fails`, { retryable: true });
    return { ok: true, attempt: env.attempt };
  },
  'wf:double:v1': async (payload) => {
    await new Promise((r) => setTimeout(r, 150)); // long enough to publish ACCEPTED/RUNNING
    const n = payload && typeof payload.n === 'number' ? payload.n : 0;
    return { n: n * 2, by: AGENT_ID, lang: 'js' };
  },
};
if (process.env.REACH_AGENT_CAPS) { // a single-handler agent serves routes by agent id alone
  const keep = new Set(process.env.REACH_AGENT_CAPS.split(','));
  for (const k of keep) if (!HANDLERS[k]) configError(`REACH_AGENT_CAPS: no handler ${k}`);
  for (const k of Object.keys(HANDLERS)) if (!keep.has(k)) delete HANDLERS[k];
}
const CAPS = Object.keys(HANDLERS).sort();

function pickHandler(capability) {
  if (capability === null || capability === undefined) {
    return CAPS.length === 1 ? HANDLERS[CAPS[0]] : null; // "the agent's only handler"
  }
  return HANDLERS[capability] || null;
}

// ---------------------------------------------------------------- trace
const TP_RE = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$/;
function validTraceparent(tp) {
  if (!tp) return false;
  const m = TP_RE.exec(tp.trim());
  if (!m) return false;
  if (m[1] === 'ff' || /^0+$/.test(m[2]) || /^0+$/.test(m[3])) return false;
  if (m[1] === '00' && m[5]) return false;
  return true;
}
function newTraceparent() {
  return `00-${crypto.randomBytes(16).toString('hex')}-${crypto.randomBytes(8).toString('hex')}-01`;
}
// Continue the trace: same trace id, new span id.
function traceHeaders(inHdrs) {
  const h = mkHeaders();
  let tp = inHdrs ? inHdrs.get('traceparent') : '';
  tp = tp ? tp.trim() : '';
  if (validTraceparent(tp)) {
    const parts = tp.split('-');
    h.set('traceparent', `00-${parts[1]}-${crypto.randomBytes(8).toString('hex')}-${parts[3]}`);
    const ts = inHdrs.get('tracestate');
    if (ts) h.set('tracestate', ts);
  } else {
    h.set('traceparent', newTraceparent());
  }
  return h;
}

// ---------------------------------------------------------------- state
let nc, js, jsm;
let inflight = 0;
let queued = 0;
let draining = false;
// An operator's cordon, as the hubs' register/heartbeat replies say it (protocol.md,
// "Heartbeat"): while true, a new task id is refused REACH_AGENT_BUSY (details.cordoned).
let cordoned = false;
function heardCordon(r) {
  if (!r || typeof r !== 'object') return;
  const now = r.cordoned === true || r.state === 'CORDONED';
  if (now !== cordoned) log(now ? 'cordoned: refusing new task ids' : 'uncordoned');
  cordoned = now;
}
// request-reply idempotency: task_id -> {attempt, promise, reply}
const rrTasks = new Map();
// workflow steps: task_id -> {workflow_id, step, attempt, state, reply, running: {...}}
const wfTasks = new Map();
// fence promises: task_id -> [{workflow_id|null, attempt}]
const promises = new Map();
// messages in hand (arrived, fence being read): task_id -> {attempt, workflow_id}
const inHand = new Map();
const MAX_REMEMBER = 10000;

function remember(map, key, val) {
  map.delete(key);
  map.set(key, val);
  while (map.size > MAX_REMEMBER) map.delete(map.keys().next().value);
}

function promised(taskId, workflowId, attempt) {
  const ps = promises.get(taskId) || [];
  for (const p of ps) {
    const covers = p.workflow_id == null || workflowId == null || p.workflow_id === workflowId;
    if (covers && attempt <= p.attempt) return true;
  }
  return false;
}
function addPromise(taskId, workflowId, attempt) {
  const ps = promises.get(taskId) || [];
  ps.push({ workflow_id: workflowId || null, attempt });
  remember(promises, taskId, ps);
}

// ---------------------------------------------------------------- helpers
function errorBody(code, message, details) {
  const e = { code, message };
  if (details !== undefined) e.details = details;
  return { error: e };
}
function toError(e) {
  if (e instanceof HandlerError) {
    return { code: e.code.slice(0, 64), message: String(e.message).slice(0, 2000), details: e.details || {} };
  }
  return { code: 'REACH_HANDLER_FAILED', message: String(e && e.message || e).slice(0, 2000), details: {} };
}
function withTimeout(p, seconds) {
  let t;
  return Promise.race([
    p.finally(() => clearTimeout(t)),
    new Promise((_, rej) => { t = setTimeout(() => rej(new Error('__timeout__')), seconds * 1000); }),
  ]);
}
async function runHandler(handler, payload, timeout, env) {
  const t0 = now();
  try {
    const result = await withTimeout(Promise.resolve().then(() => handler(payload, env)), timeout);
    return { state: 'SUCCEEDED', result, error: null, duration_ms: now() - t0 };
  } catch (e) {
    if (e && e.message === '__timeout__') {
      return { state: 'TIMEOUT', result: null, error: { code: 'REACH_TIMEOUT', message: `handler exceeded ${timeout}s`, details: {} }, duration_ms: now() - t0 };
    }
    return { state: 'FAILED', result: null, error: toError(e), duration_ms: now() - t0 };
  }
}
function makeReply(env, out, queuedMs, cached) {
  return {
    task_id: env.task_id, attempt: env.attempt, agent_id: AGENT_ID, state: out.state,
    result: out.result === undefined ? null : out.result, error: out.error || null,
    duration_ms: out.duration_ms || 0, queued_ms: queuedMs || 0, cached: !!cached,
  };
}
const ID_RE = /^[A-Za-z0-9_-]{1,64}$/;

// ---------------------------------------------------------------- request-reply tasks
async function onTask(msg) {
  if (!msg.reply || !msg.reply.startsWith('_INBOX.')) return; // answers go to inboxes only
  if (msg.subject !== `reach.agent.${AGENT_ID}.task`) return;
  const hdrs = traceHeaders(msg.headers);
  const respond = (body) => nc.publish(msg.reply, enc(body), { headers: hdrs });
  const env = dec(msg.data);
  if (!env || typeof env !== 'object' || !ID_RE.test(env.task_id || '')) {
    return respond(errorBody('REACH_BAD_REQUEST', 'not a TaskEnvelope', { field: 'task_id' }));
  }
  const attempt = Number.isInteger(env.attempt) ? env.attempt : 1;
  const handler = pickHandler(env.capability ?? null);
  if (!handler) return respond(errorBody('REACH_NO_HANDLER', `${AGENT_ID} has no handler for ${env.capability ?? 'null (agent id only, several handlers)'}`, { agent_id: AGENT_ID, capabilities: CAPS }));
  const known = rrTasks.get(env.task_id);
  if (known) {
    if (known.running) {
      const r = await known.running; // same run
      return respond(r);
    }
    if (known.reply.state === 'SUCCEEDED' || attempt <= known.reply.attempt) {
      return respond({ ...known.reply, attempt, cached: true });
    }
    // later attempt of a failed/timed-out task: run again
  } else if (cordoned) {
    return respond(errorBody('REACH_AGENT_BUSY', `${AGENT_ID} is cordoned by an operator: it takes no new tasks`, { agent_id: AGENT_ID, cordoned: true, retryable: true }));
  }
  if (draining || inflight >= MAX_CONCURRENCY) {
    return respond(errorBody('REACH_AGENT_BUSY', draining ? 'draining' : 'at capacity', { retryable: true }));
  }
  inflight++;
  const tIn = now();
  const entry = { running: null, reply: null };
  entry.running = (async () => {
    const out = await runHandler(handler, env.payload ?? null, Number(env.timeout) || 30, env);
    return makeReply({ ...env, attempt }, out, now() - tIn - out.duration_ms, false);
  })();
  remember(rrTasks, env.task_id, entry);
  const reply = await entry.running;
  inflight--;
  entry.reply = reply; entry.running = null;
  log('task', env.task_id, env.capability, '->', reply.state);
  respond(reply);
}

// ---------------------------------------------------------------- ctl
function onCtl(msg) {
  if (!msg.reply || !msg.reply.startsWith('_INBOX.')) return;
  if (msg.subject !== `reach.agent.${AGENT_ID}.ctl`) return;
  const respond = (o) => nc.publish(msg.reply, enc(o));
  const q = dec(msg.data);
  if (!q || typeof q !== 'object') return respond(errorBody('REACH_BAD_REQUEST', 'not JSON'));
  if (q.op === 'ping') {
    return respond({ agent_id: AGENT_ID, status: draining ? 'draining' : 'running', inflight, queued, session: SESSION });
  }
  if (q.op === 'task_state') {
    if (!ID_RE.test(q.task_id || '')) return respond(errorBody('REACH_BAD_REQUEST', 'task_id', { field: 'task_id' }));
    if (q.fence !== undefined && q.fence !== null && !(Number.isInteger(q.fence) && q.fence >= 1)) {
      return respond(errorBody('REACH_BAD_REQUEST', 'fence must be an integer >= 1', { field: 'fence' }));
    }
    // `next` (asked after the hub's fence): this agent does not keep a revived attempt past
    // that record (the hub then waits its silence timeout, as for an `undelivered` give-up),
    // but refuses a malformed one as the protocol says.
    if (q.next !== undefined && q.next !== null
        && !(Number.isInteger(q.next) && Number.isInteger(q.fence) && q.next > q.fence)) {
      return respond(errorBody('REACH_BAD_REQUEST', 'next must be an attempt after fence', { field: 'next' }));
    }
    const wfId = q.workflow_id || null;
    let t = wfTasks.get(q.task_id);
    if (t && wfId && t.workflow_id !== wfId) t = null; // another workflow's: not reported
    const hand = inHand.get(q.task_id);
    if (t && t.running) {
      return respond({ task_id: q.task_id, attempt: t.attempt, state: t.running.state });
    }
    if (hand && (!wfId || hand.workflow_id === wfId)) {
      return respond({ task_id: q.task_id, state: 'DELIVERED' });
    }
    if (!t && !wfId) {
      const rr = rrTasks.get(q.task_id);
      if (rr && rr.reply) return respond(rr.reply);
    }
    let ans;
    if (t && t.reply) ans = { ...t.reply };
    else ans = { task_id: q.task_id, state: 'PENDING' };
    if (q.fence) {
      // promise never to start attempt <= fence (unless we finished a later one)
      if (!(t && t.reply && t.reply.attempt >= q.fence)) {
        addPromise(q.task_id, wfId, q.fence);
        ans.fenced = true;
      }
    }
    return respond(ans);
  }
  if (q.op === 'cancel') {
    if (!(Number.isInteger(q.attempt) && q.attempt >= 1)) {
      return respond(errorBody('REACH_BAD_REQUEST', 'attempt must be an integer >= 1', { field: 'attempt' }));
    }
    const t = wfTasks.get(q.task_id);
    if (t && t.running && t.attempt === q.attempt && (!q.workflow_id || t.workflow_id === q.workflow_id)) {
      t.running.cancelled = true;
      t.running.cancel();
      return respond({ task_id: q.task_id, cancelled: true });
    }
    if (!(t && t.reply && t.reply.attempt >= q.attempt)) addPromise(q.task_id, q.workflow_id || null, q.attempt);
    return respond({ task_id: q.task_id, cancelled: false });
  }
  return respond(errorBody('REACH_BAD_REQUEST', `unknown op ${q.op}`, { field: 'op' }));
}

// ---------------------------------------------------------------- registration / heartbeat
function card() {
  return {
    agent_id: AGENT_ID,
    capabilities: CAPS,
    labels: { lang: 'javascript', runtime: 'node20', region: 'eu-west' },
    tools: [{ name: 'upper', description: 'Upper-case a text',
      parameters: { type: 'object', properties: { text: { type: 'string' } }, required: ['text'] },
      capability: 'text:upper:v1' }],
    max_concurrency: MAX_CONCURRENCY,
    weight: 1.0,
    region: 'eu-west',
    metadata: { impl: 'reach-mesh conformance/js/agent.js' },
    version: '0.1.0',
    durable_work: true,
    batch: false,
  };
}
async function hubRequest(subject, body, timeoutMs) {
  const m = await nc.request(subject, enc(body), { timeout: timeoutMs });
  const a = dec(m.data);
  if (a && typeof a === 'object' && Object.keys(a).length === 1 && a.error && typeof a.error === 'object') {
    const err = new Error(`${a.error.code}: ${a.error.message}`);
    err.reach = a.error;
    throw err;
  }
  return a;
}
async function register() {
  const subj = `reach.hub.${NS}.register.${SERVICE}.${INSTANCE}`;
  for (let i = 0; ; i++) {
    try {
      const r = await hubRequest(subj, { card: card(), session: SESSION, heartbeat_interval: HB_INTERVAL, lease_timeout: LEASE }, 2000);
      log('registered', JSON.stringify(r));
      heardCordon(r);
      return r;
    } catch (e) {
      let wait = Math.min(5000, 200 * 2 ** i);
      if (e.reach && e.reach.code === 'REACH_THROTTLED') wait = (e.reach.details?.retry_after_ms || 1000);
      else if (e.reach) throw e;
      wait = wait * (1 + Math.random() * 0.3);
      log('register failed:', e.message, 'retry in', Math.round(wait), 'ms');
      await new Promise((r) => setTimeout(r, wait));
    }
  }
}
let hbTimer;
async function heartbeatOnce() {
  const subj = `reach.hub.${NS}.heartbeat.${SERVICE}.${INSTANCE}`;
  const body = { agent_id: AGENT_ID, session: SESSION, inflight: Math.min(inflight, MAX_CONCURRENCY), queue_depth: queued,
    pressure: 0.0, unavailable: [], draining };
  const waitMs = Math.max(50, (HB_INTERVAL * 1000) / 6);
  for (let i = 0; i < 3; i++) {
    try {
      heardCordon(await hubRequest(subj, body, waitMs));
      return;
    } catch (e) {
      if (e.reach && e.reach.code === 'REACH_UNKNOWN_AGENT') {
        log('hub does not know us: registering again');
        await register();
        return;
      }
      if (e.reach) { log('heartbeat error', e.message); return; }
      // no answer / no responders: send the same beat again at once
    }
  }
  log('heartbeat: no hub answered 3 tries');
}
function startHeartbeats() {
  hbTimer = setInterval(() => { heartbeatOnce().catch((e) => log('hb', e.message)); }, HB_INTERVAL * 1000);
}

// ---------------------------------------------------------------- workflows
function consumerName(prefix, agentId) {
  const h = crypto.createHash('sha256').update(agentId, 'utf8').digest('hex');
  const idPart = agentId.replace(/\./g, '_');
  let name = `${prefix}-${idPart}-${h.slice(0, 10)}`;
  if (name.length > 200) {
    const room = 200 - prefix.length - 2 - 32;
    name = `${prefix}-${idPart.slice(0, room)}-${h.slice(0, 32)}`;
  }
  return name;
}
const WORK_CONSUMER = consumerName('work', AGENT_ID);
const STATUS_CONSUMER = consumerName('status', AGENT_ID);
const STATUS_SUBJ = (taskId) => `reach.status.${AGENT_ID}.${taskId}`;

function finalNonce(taskId, attempt) {
  return crypto.createHmac('sha256', NONCE_KEY).update(`${NS}.${taskId}#${attempt}`).digest('hex').slice(0, 32);
}
function publishStatus(hdrs, ev) {
  nc.publish(STATUS_SUBJ(ev.task_id), enc(ev), { headers: hdrs });
}
async function publishFinal(hdrs, ev) {
  const h = mkHeaders();
  for (const [k, v] of hdrs) h.set(k, v[0]);
  const msgID = `${NS}.${ev.task_id}#${ev.attempt}.final.${finalNonce(ev.task_id, ev.attempt)}`;
  for (let i = 0; i < 10; i++) {
    try {
      const pa = await js.publish(STATUS_SUBJ(ev.task_id), enc(ev), { headers: h, msgID, expect: { streamName: 'REACH_STATUS' }, timeout: 2000 });
      return pa;
    } catch (e) {
      log('final status publish failed', e.message);
      await new Promise((r) => setTimeout(r, 250 * (i + 1)));
    }
  }
  throw new Error('final status not stored');
}
function statusEvent(env, state, extra) {
  // Numbers stay numbers: a null where the type is not nullable makes the event invalid.
  const ev = {
    task_id: env.task_id, attempt: env.attempt, agent_id: AGENT_ID, state,
    workflow_id: env.workflow_id ?? null, step: env.step ?? null,
    cached: false, duration_ms: 0.0, queued_ms: 0.0,
    ...extra,
  };
  for (const k of Object.keys(ev)) if (ev[k] === null || ev[k] === undefined) delete ev[k];
  return ev;
}

// Direct get of reach_tasks <ns>.<task_id>; returns record, null (none) or throws (unreadable).
async function readTaskRecord(taskId) {
  const subj = `$JS.API.DIRECT.GET.KV_reach_tasks.$KV.reach_tasks.${NS}.${taskId}`;
  let m;
  try {
    m = await nc.request(subj, new Uint8Array(0), { timeout: 1000 });
  } catch (e) {
    if (e.code === ErrorCode.NoResponders) throw new Error('direct get: no responders');
    throw e;
  }
  if (m.headers && m.headers.hasError) {
    if (m.headers.code === 404) return null;
    throw new Error(`direct get: ${m.headers.code} ${m.headers.description}`);
  }
  const op = m.headers && m.headers.get('KV-Operation');
  if (op === 'DEL' || op === 'PURGE') return null;
  if (!m.data || m.data.length === 0) return null;
  const rec = dec(m.data);
  if (!rec || typeof rec !== 'object' || typeof rec.task_id !== 'string') return null;
  return rec;
}
function fencedByRecord(rec, env) {
  if (!rec) return false;
  if (rec.workflow_id !== env.workflow_id || rec.step !== env.step) return 'other step';
  if (rec.attempt !== env.attempt) return `attempt ${rec.attempt} != ${env.attempt}`;
  if (rec.cancelled) return 'cancelled';
  if (['SUCCEEDED', 'FAILED', 'TIMEOUT'].includes(rec.state)) return `record final ${rec.state}`;
  if (rec.agent_id !== null && rec.agent_id !== undefined && rec.agent_id !== AGENT_ID) return `agent ${rec.agent_id}`;
  return false;
}

async function onWork(m) {
  const hdrs = m.headers;
  const fence = hdrs && hdrs.get('Reach-Fence');
  if (fence) {
    const b = dec(m.data);
    if (!b || !ID_RE.test(b.task_id || '') || !(Number.isInteger(b.attempt) && b.attempt >= 1)) { m.term(); return; }
    addPromise(b.task_id, typeof b.workflow_id === 'string' && b.workflow_id ? b.workflow_id : null, b.attempt);
    log('fence marker', b.task_id, '#', b.attempt);
    m.ack();
    return;
  }
  const env = dec(m.data);
  if (!env || !ID_RE.test(env.task_id || '') || !(Number.isInteger(env.attempt) && env.attempt >= 1)) {
    log('bad work message, term'); m.term(); return;
  }
  const arrived = now();
  const th = traceHeaders(hdrs);
  const n = env.attempt;
  // fence promises first (synchronously with the "in hand" mark)
  if (promised(env.task_id, env.workflow_id, n)) { log('promised away', env.task_id, n); m.ack(); return; }
  let t = wfTasks.get(env.task_id);
  if (t && !(t.workflow_id === env.workflow_id && t.step === env.step) && env.workflow_id != null && t.workflow_id != null) {
    if (t.running) { m.nak(500); return; }
    wfTasks.delete(env.task_id); t = null; // another step's: forget
  }
  if (t) {
    const mm = t.attempt;
    if (t.running) {
      if (n > mm) {
        t.attempt = n; t.env = env; t.msgs.push(m); t.hdrs = th;
        publishStatus(th, statusEvent(env, 'DELIVERED'));
        publishStatus(th, statusEvent(env, 'ACCEPTED'));
        publishStatus(th, statusEvent(env, 'RUNNING'));
      } else {
        t.msgs.push(m);
      }
      return;
    }
    if (t.reply) {
      if (n < mm) { m.ack(); return; }
      if (n === mm || t.reply.state === 'SUCCEEDED') {
        const ev = statusEvent(env, t.reply.state, {
          result: t.reply.result, error: t.reply.error, cached: true,
          duration_ms: t.reply.duration_ms, queued_ms: t.reply.queued_ms, attempt: n,
        });
        try { await publishFinal(th, ev); m.ack(); } catch (e) { m.nak(1000); }
        return;
      }
      // FAILED/TIMEOUT and n > m: run again, fenced
    }
  }
  inHand.set(env.task_id, { attempt: n, workflow_id: env.workflow_id ?? null });
  let rec;
  if (env.workflow_id != null) {
    try { rec = await readTaskRecord(env.task_id); } catch (e) {
      inHand.delete(env.task_id);
      log('fence read failed', e.message); m.nak(500); return;
    }
    const why = fencedByRecord(rec, env);
    if (why) { inHand.delete(env.task_id); log('fenced', env.task_id, '#', n, why); m.ack(); return; }
  }
  const handler = pickHandler(env.capability ?? null);
  inHand.delete(env.task_id);
  if (promised(env.task_id, env.workflow_id, n)) { m.ack(); return; }
  if (!handler) {
    const ev = statusEvent(env, 'FAILED', { error: { code: 'REACH_NO_HANDLER', message: `${AGENT_ID} has no handler for ${env.capability ?? 'null (agent id only, several handlers)'}`, details: { retryable: true } }, duration_ms: 0, queued_ms: 0 });
    try { await publishFinal(th, ev); m.ack(); } catch (e) { m.nak(1000); }
    return;
  }
  // run
  const entry = { workflow_id: env.workflow_id ?? null, step: env.step ?? null, attempt: n, env, reply: null, msgs: [m], hdrs: th, running: null };
  let cancelFn;
  const cancelP = new Promise((res) => { cancelFn = res; });
  entry.running = { state: 'ACCEPTED', cancel: () => cancelFn('__cancelled__'), cancelled: false };
  remember(wfTasks, env.task_id, entry);
  inflight++;
  const queuedMs = now() - arrived;
  publishStatus(th, statusEvent(env, 'DELIVERED'));
  publishStatus(th, statusEvent(env, 'ACCEPTED', { queued_ms: queuedMs }));
  entry.running.state = 'RUNNING';
  publishStatus(entry.hdrs, statusEvent(entry.env, 'RUNNING'));
  const keep = setInterval(() => {
    publishStatus(entry.hdrs, statusEvent(entry.env, 'RUNNING'));
    for (const mm of entry.msgs) mm.working();
  }, Math.min(RUNNING_INTERVAL_S, WORK_ACK_WAIT_S / 3) * 1000);
  const out = await Promise.race([runHandler(handler, env.payload ?? null, Number(env.timeout) || 30, env), cancelP]);
  clearInterval(keep);
  inflight--;
  if (out === '__cancelled__') {
    log('cancelled', env.task_id, '#', entry.attempt);
    entry.running = null;
    entry.reply = null;
    wfTasks.delete(env.task_id);
    addPromise(env.task_id, entry.workflow_id, entry.attempt);
    for (const mm of entry.msgs) mm.ack();
    return;
  }
  const finalAttempt = entry.attempt;
  const reply = makeReply({ ...entry.env, attempt: finalAttempt }, out, queuedMs, false);
  const ev = statusEvent(entry.env, reply.state, {
    attempt: finalAttempt, result: reply.result, error: reply.error, duration_ms: reply.duration_ms, queued_ms: reply.queued_ms,
  });
  try {
    await publishFinal(entry.hdrs, ev);
    entry.reply = reply; entry.running = null;
    for (const mm of entry.msgs) mm.ack();
    log('step', env.workflow_id, env.step, env.task_id, '#', finalAttempt, '->', reply.state);
  } catch (e) {
    entry.running = null; wfTasks.delete(env.task_id);
    for (const mm of entry.msgs) mm.nak(1000);
  }
}

async function ensureStream(name, cfg) {
  try { await jsm.streams.info(name); return; } catch (e) {
    if (!/stream not found/i.test(e.message)) throw e;
  }
  log('creating missing stream', name);
  await jsm.streams.add({ name, ...cfg });
}

// Rebuild the idempotency table from the last status of each of our tasks. A *push* consumer
// (deliver subject in our own inbox, flow control): in secure mode an agent may CREATE, INFO
// and DELETE its status consumer but not MSG.NEXT on it, so a pull consumer cannot be read.
async function rebuildFromStatus() {
  try { await jsm.consumers.delete('REACH_STATUS', STATUS_CONSUMER); } catch (e) { /* not found */ }
  const deliver = `${nc.options.inboxPrefix}.${crypto.randomBytes(11).toString('hex')}`;
  const sub = nc.subscribe(deliver);
  let kept = 0;
  const filterTokens = `reach.status.${AGENT_ID}.*`.split('.');
  try {
    const ci = await jsm.consumers.add('REACH_STATUS', {
      name: STATUS_CONSUMER,
      filter_subject: `reach.status.${AGENT_ID}.*`,
      deliver_subject: deliver,
      deliver_policy: DeliverPolicy.LastPerSubject,
      ack_policy: AckPolicy.None,
      flow_control: true,
      idle_heartbeat: nanos(5000),
      mem_storage: true,
      num_replicas: 1,
      inactive_threshold: nanos(60_000),
    });
    if (ci.num_pending === 0) return;
    const deadline = Date.now() + 10000;
    for await (const m of sub) {
      if (m.headers && (!m.data || m.data.length === 0) && m.headers.code === 100) {
        if (m.reply) nc.publish(m.reply); // flow control request: answer on $JS.FC...
        if (Date.now() > deadline) break;
        continue;
      }
      if (!m.reply || !m.reply.startsWith('$JS.ACK.')) continue; // not a JetStream delivery
      const toks = m.subject.split('.');
      const inFilter = toks.length === filterTokens.length && filterTokens.every((t, i) => t === '*' || t === toks[i]);
      const ev = inFilter ? dec(m.data) : undefined;
      if (ev && ['SUCCEEDED', 'FAILED', 'TIMEOUT'].includes(ev.state) && ev.agent_id === AGENT_ID) {
        remember(wfTasks, ev.task_id, {
          workflow_id: ev.workflow_id ?? null, step: ev.step ?? null, attempt: ev.attempt, running: null, msgs: [],
          reply: { task_id: ev.task_id, attempt: ev.attempt, agent_id: ev.agent_id, state: ev.state, result: ev.result ?? null,
            error: ev.error ?? null, duration_ms: ev.duration_ms ?? 0, queued_ms: ev.queued_ms ?? 0, cached: !!ev.cached },
        });
        kept++;
      }
      // $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending> (v1; v2 has 2 more tokens after ACK)
      const a = m.reply.split('.');
      const pending = Number(a.length >= 12 ? a[a.length - 2] : a[a.length - 1]);
      if (pending === 0 || Date.now() > deadline) break;
    }
  } finally {
    sub.unsubscribe();
    try { await jsm.consumers.delete('REACH_STATUS', STATUS_CONSUMER); } catch (e) { /* ignore */ }
    log(`rebuilt ${kept} final statuses from REACH_STATUS`);
  }
}

let workIter;
async function startWork() {
  const retention = nanos(WORKFLOW_RETENTION_S * 1000);
  await ensureStream('REACH_WORK', { subjects: ['reach.work.*.>'], retention: RetentionPolicy.Workqueue, max_age: retention, duplicate_window: nanos(600_000) });
  await ensureStream('REACH_STATUS', { subjects: ['reach.status.*.*.*.*'], max_age: retention });
  await rebuildFromStatus();
  await jsm.consumers.add('REACH_WORK', {
    name: WORK_CONSUMER,
    durable_name: WORK_CONSUMER,
    filter_subject: `reach.work.${NS}.${AGENT_ID}`,
    ack_policy: AckPolicy.Explicit,
    deliver_policy: DeliverPolicy.All,
    max_deliver: -1,
    ack_wait: nanos(WORK_ACK_WAIT_S * 1000),
    max_ack_pending: Math.max(2 * CAPACITY, 64),
    inactive_threshold: retention,
  });
  const c = await js.consumers.get('REACH_WORK', WORK_CONSUMER);
  workIter = await c.consume({ max_messages: CAPACITY });
  (async () => {
    for await (const m of workIter) {
      if (m.subject !== `reach.work.${NS}.${AGENT_ID}`) { m.term(); continue; }
      onWork(m).catch((e) => log('work error', e.stack));
    }
  })();
  log('work consumer', WORK_CONSUMER, 'pulling');
}

// ---------------------------------------------------------------- main
async function main() {
  // Signal handlers first: Node starts listening for a signal some time after process.on(),
  // and a SIGTERM that comes before must still drain and unregister, not kill.
  let shutdown = null;
  let stopAsked = null;
  const onSignal = (sig) => { if (shutdown) shutdown(sig); else stopAsked = stopAsked || sig; };
  process.on('SIGTERM', () => onSignal('SIGTERM'));
  process.on('SIGINT', () => onSignal('SIGINT'));
  const opts = { servers: NATS_URL, inboxPrefix: process.env.REACH_INBOX_PREFIX || '_INBOX', name: AGENT_ID, maxReconnectAttempts: -1 };
  if (process.env.REACH_NKEY_SEED_FILE) {
    const seed = fs.readFileSync(process.env.REACH_NKEY_SEED_FILE, 'utf8').trim();
    opts.authenticator = nkeyAuthenticator(te.encode(seed));
  }
  nc = await connect(opts);
  js = nc.jetstream();
  jsm = await nc.jetstreamManager();
  // one process per agent id
  for (;;) {
    try {
      await nc.request(`reach.agent.${AGENT_ID}.ctl`, enc({ op: 'ping' }), { timeout: 1000 });
      log('REACH-AGENT-ID-IN-USE: another process serves', AGENT_ID, '- waiting');
      await new Promise((r) => setTimeout(r, 1000));
    } catch (e) {
      if (e.code === ErrorCode.NoResponders) break;
      if (e.code === ErrorCode.Timeout) { log('ping: no answer, asking again'); continue; }
      throw e;
    }
  }
  const taskSub = nc.subscribe(`reach.agent.${AGENT_ID}.task`, { queue: 'reach-agent' });
  (async () => { for await (const m of taskSub) onTask(m).catch((e) => log('task error', e.stack)); })();
  const ctlSub = nc.subscribe(`reach.agent.${AGENT_ID}.ctl`);
  (async () => { for await (const m of ctlSub) { try { onCtl(m); } catch (e) { log('ctl error', e.stack); } } })();
  await nc.flush();
  await startWork();
  await register();
  startHeartbeats();
  console.log(`serving ${AGENT_ID} capabilities=${CAPS.join(',')}`);

  let stopping = false;
  shutdown = async (sig) => {
    if (stopping) return; stopping = true;
    log('got', sig, ': draining');
    setTimeout(() => { log('shutdown took too long: exiting'); process.exit(1); }, 45000).unref();
    draining = true;
    // keep heartbeating (draining: true) while in-flight work finishes, or the lease lapses
    await heartbeatOnce().catch(() => {});
    if (workIter) workIter.stop();
    const t0 = now();
    while ((inflight > 0) && now() - t0 < 30000) await new Promise((r) => setTimeout(r, 50));
    try {
      const r = await hubRequest(`reach.hub.${NS}.unregister.${SERVICE}.${INSTANCE}`, { agent_id: AGENT_ID, session: SESSION }, 2000);
      log('unregistered', JSON.stringify(r));
    } catch (e) { log('unregister failed', e.message); }
    clearInterval(hbTimer);
    await Promise.race([nc.drain(), new Promise((r) => setTimeout(r, 5000))]);
    process.exit(0);
  };
  if (stopAsked) shutdown(stopAsked);
}
main().catch((e) => { log('fatal', e.stack || e); process.exit(1); });
