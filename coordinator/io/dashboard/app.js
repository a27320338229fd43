// fleetwire dashboard: a client session over the JSON subprotocol (docs/PROTOCOL.md).
//
// The token travels as an offered subprotocol `fleetwire.bearer.<base64url token>` (browsers
// cannot set an Authorization header); the coordinator never selects it. It comes from the login
// form and is kept in sessionStorage (this tab only, gone when it closes), never in the URL, so it
// stays out of the browser's history. A #token=... link (the old way) is never used: the page
// removes the fragment from the address bar and its history entry (history.replaceState) and
// asks to log in with the form instead. A #plan=<id> link opens that plan's detail.
//
// Live data: `subscribe(all, from_seq=MAX)` makes the coordinator push every future event of every
// plan this token may see (an admin token: all plans) without replaying history; `list_plans` and
// `list_workers` give snapshots, polled every few seconds. The plan list is one page of a
// `list_plans` filtered by the coordinator (state, op, owner, a part of the id) and paged with its
// `next_cursor`: the page asks for `pageSize` rows, never every plan. Listings are summaries (no result
// bodies, only `result_bytes`): the selected plan's result is fetched on demand with `get_plan`, once
// it ends. Everything is rendered with textContent, never innerHTML, so nothing a worker or a client
// sends can inject markup.
//
// Rendering holds at hundreds of plans a second (issue #25 part 9: the page froze 4-10 s at ~100/s):
// an event only updates records and marks what it changed; the page is redrawn at most once per
// animation frame and no more often than every RENDER_EVERY_MS, with at most one page of rows and
// one page of queue entries. Plans not on the page are tracked only while they live (for the counts,
// the charts and the queue), and listings asked for on unknown plans are coalesced (LEARN_EVERY_MS).
//
// Charts (charts.js draws them): series are computed here, in the page, from what it already
// receives: terminal events give plans/s by outcome, submit->result latency (from the plan's
// first `queued` event to its end, as this page saw them) and energy and gCO2e (the receipts the
// terminal events carry: the same figures as each plan's receipt); the listings give the queue depth
// (`counts.queued`, the true number, not the length of the capped `queue` list); `list_workers`
// gives in-flight and load per worker. Nothing new is asked of the coordinator, so the charts cost
// it nothing; they start when the page opens and keep the last hour.
"use strict";

const JSON_SUBPROTOCOL = "fleetwire.v1.json";
const BEARER_PREFIX = "fleetwire.bearer.";
const NO_REPLAY = Number.MAX_SAFE_INTEGER; // from_seq past any event: live events only
const WORKERS_EVERY_MS = 2000;
const PLANS_EVERY_MS = 5000;
const LEARN_EVERY_MS = 1000; // a listing asked for unknown plans (their op), at most this often
const RENDER_EVERY_MS = 100; // the page is redrawn at most this often (and once per animation frame)
const PAGE_SIZES = [25, 50, 100, 200];
const DEFAULT_PAGE_SIZE = 100;
const MAX_EVENT_ROWS = 500;
const MAX_TRACKED = 20000; // plans off the page followed for the counts (oldest dropped first)
const HOUR_MS = 3600 * 1000;
const RATE_BUCKET_MS = 10 * 1000; // plans/s, latency percentiles and energy per 10 s
const CHARTS_EVERY_MS = 2000;
const MAX_SEEN = 20000; // plans whose first-seen time is kept (latency), oldest dropped first
const FILTER_DELAY_MS = 300; // typing in a filter asks for a listing once it pauses this long
// Plan states in the order the counts show them, whatever order the coordinator sends.
const STATE_ORDER = ["queued", "leased", "running", "succeeded", "failed", "cancelled"];
const UNFINISHED = ["queued", "leased", "running"];
const MAX_RESULT_CHARS = 20000; // a result shown longer than this is cut (the page stays responsive)
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
// Lifecycle event kind -> the plan state it means (docs/PROTOCOL.md §6).
const KIND_STATE = {
  queued: "queued", waiting: "queued", requeued: "queued", leased: "leased", running: "running",
  succeeded: "succeeded", failed: "failed", cancelled: "cancelled",
};

const state = {
  ws: null,
  token: "",
  nextReqId: 1,
  pending: new Map(), // req_id -> callback(reply)
  pendingSubmit: 0, // req_id of a submit not answered yet (a `moved` or a close says why it never will be)
  rows: new Map(), // the page's plans, newest first: id -> {id, op, state, worker_id, attempt, last_seq, ...}
  tracked: new Map(), // live plans off the page (counts): id -> the same record; ended ones are dropped
  queue: [], // queued plan ids in placement order (the listing's, then moved by events)
  queueKnown: true, // false: plans wait but the listing gave no order (a cluster's main port: each shard has its own)
  waiting: {}, // plan id -> why it waits (the listing's `waiting`, then `waiting` events)
  counts: {},
  total: 0, // plans matching the filter (the listing's `total`)
  filter: { states: [], op: "", owner: "", id_contains: "" },
  pageSize: DEFAULT_PAGE_SIZE,
  cursors: [""], // the cursor of each page up to the one shown ("": the newest)
  nextCursor: "", // the listing's: an older page follows
  listingSeq: 0, // the newest listing asked for; older replies are ignored
  workers: [],
  summary: "",
  selected: null,
  selectedSeq: 0,
  timers: [],
  learnTimer: null,
  lastLearn: 0,
  filterTimer: null,
  reconnectDelay: 500,
  everConnected: false,
  workersLoaded: false, // a list_workers reply arrived on this connection
  plansLoaded: false,
  detail: null, // the selected plan's record from get_plan
  eventTimes: new Map(), // "plan_id:seq" -> ms the page received it live (the detail's times)
  seenAt: new Map(), // plan_id -> ms its first event (seq 1) arrived live: submit->result latency
  charts: null, // made at start (charts.js)
  dirty: new Set(), // parts to redraw: "plans", "queue", "counts", "detail", "workers"
  renderQueued: false,
  lastRender: 0,
  renders: 0, // redraws so far (the browser test reads it)
};

function makeCharts() {
  const { TimeSeries, Buckets } = window.fleetCharts;
  return {
    since: Date.now(),
    outcomes: { succeeded: new Buckets(HOUR_MS, RATE_BUCKET_MS), failed: new Buckets(HOUR_MS, RATE_BUCKET_MS),
      cancelled: new Buckets(HOUR_MS, RATE_BUCKET_MS) },
    latencies: new Map(), // bucket start -> [seconds]
    queue: new TimeSeries(HOUR_MS),
    inflight: new Map(), // worker id -> TimeSeries
    load: new Map(),
    joules: new Buckets(HOUR_MS, RATE_BUCKET_MS), // receipts' joules per bucket of the plan's end
    grams: new Buckets(HOUR_MS, RATE_BUCKET_MS), // receipts' gCO2e likewise
    receipts: 0, // receipts counted (the chart's note)
    joulesSeen: 0, // their sum: the figure the note shows, the same as the rows' receipts
  };
}

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let binary = "";
  for (const b of bytes) binary += String.fromCharCode(b);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

// A token in the address's fragment (#token=..., the old links) is refused, never read: it is removed
// from the address bar and from this history entry, and the form asks to log in. True when there was one.
function refuseTokenInLink() {
  if (!new URLSearchParams(location.hash.replace(/^#/, "")).has("token")) return false;
  history.replaceState(null, "", location.pathname + location.search);
  showTokenForm("the token in the link was ignored: a token in a URL is kept in the browser's history; "
    + "log in with the form instead");
  return true;
}

// #plan=<id>: the plan whose detail the address names (a link from the queue or the list, or pasted).
function planInLink() {
  return new URLSearchParams(location.hash.replace(/^#/, "")).get("plan");
}

function onHashChange() {
  if (refuseTokenInLink()) return;
  const id = planInLink();
  if (id && id !== state.selected) follow(id);
}

// ------------------------------------------------------------------ connection

function setStatus(text, kind) {
  const pill = $("conn-status");
  pill.textContent = text;
  pill.dataset.state = kind;
  pill.className = "pill " + (kind === "connected" ? "pill-on" : kind === "connecting" ? "pill-wait" : "pill-off");
  if (kind !== "connected") {
    state.workersLoaded = false;
    state.plansLoaded = false;
  }
  renderPlaceholders();
}

// "connecting…" / "disconnected" until a listing arrives; "No workers registered" only when one says so.
function renderPlaceholders() {
  const conn = $("conn-status").dataset.state;
  const filtered = filterActive() || state.cursors.length > 1;
  for (const [id, loaded, table, empty] of [
    ["no-workers", state.workersLoaded, "workers", "No workers registered."],
    ["no-plans", state.plansLoaded, "plans", filtered ? "No plans match." : "No plans yet."],
  ]) {
    const p = $(id);
    const rows = $(table).tBodies[0].rows.length;
    let text = empty;
    let kind = "empty";
    if (conn === "disconnected") [text, kind] = [rows ? "disconnected: showing the last known rows" : "disconnected", "disconnected"];
    else if (!loaded) [text, kind] = [rows ? "reconnecting…: showing the last known rows" : "connecting…", "connecting"];
    p.textContent = text;
    p.dataset.state = kind;
    p.hidden = kind === "empty" && rows > 0;
  }
}

function connect() {
  if (state.ws) state.ws.close();
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const protocols = [JSON_SUBPROTOCOL];
  if (state.token) protocols.push(BEARER_PREFIX + base64url(state.token));
  setStatus("connecting", "connecting");
  let ws;
  try {
    ws = new WebSocket(`${scheme}//${location.host}/v1/client`, protocols);
  } catch (err) {
    showTokenForm(`cannot open the websocket: ${err.message}`);
    return;
  }
  state.ws = ws;
  ws.onopen = () => {
    state.everConnected = true;
    state.reconnectDelay = 500;
    setStatus("connected", "connected");
    $("token-form").hidden = true;
    $("token-error").textContent = "";
    $("logout").hidden = !state.token;
    // One frame: the subscription is in place before the snapshot, so no event falls between them.
    send([
      request({ type: "subscribe", all: true, from_seq: NO_REPLAY }),
      listingRequest(),
      request({ type: "list_workers" }, onWorkers),
    ]);
    if (state.selected) follow(state.selected);
    state.timers.push(setInterval(() => send([request({ type: "list_workers" }, onWorkers)]), WORKERS_EVERY_MS));
    state.timers.push(setInterval(refreshPlans, PLANS_EVERY_MS));
  };
  ws.onmessage = (msg) => {
    let data;
    try {
      data = JSON.parse(msg.data);
    } catch (err) {
      console.warn("undecodable frame", err);
      return;
    }
    for (const m of Array.isArray(data) ? data : [data]) dispatch(m);
  };
  ws.onclose = (ev) => {
    if (state.ws !== ws) return; // replaced by a newer connection
    state.ws = null;
    for (const t of state.timers) clearInterval(t);
    state.timers = [];
    state.pending.clear();
    if (state.pendingSubmit) {
      state.pendingSubmit = 0;
      $("submit-error").textContent = `the connection closed before the coordinator answered (${ev.code}`
        + `${ev.reason ? ": " + ev.reason : ""}): look for the plan in the list before submitting it again`;
    }
    if (!state.everConnected) {
      // The handshake failed: a browser hides the HTTP status, but 401/403 are by far the likeliest.
      setStatus("disconnected", "disconnected");
      showTokenForm(state.token
        ? "could not connect: check the token (client or admin) and that the coordinator is up"
        : "log in: type a client or admin token (`fleetwire up` prints the admin token)");
      return;
    }
    setStatus(`reconnecting (closed ${ev.code}${ev.reason ? ": " + ev.reason : ""})`, "connecting");
    setTimeout(connect, state.reconnectDelay);
    state.reconnectDelay = Math.min(state.reconnectDelay * 2, 10000);
  };
}

function showTokenForm(message) {
  $("token-form").hidden = false;
  $("logout").hidden = true;
  $("token-error").textContent = message || "";
  $("token").focus();
}

function logOut() {
  sessionStorage.removeItem("fleetwire-token");
  state.token = "";
  state.everConnected = false;
  const ws = state.ws;
  state.ws = null;
  if (ws) ws.close();
  for (const t of state.timers) clearInterval(t);
  state.timers = [];
  setStatus("disconnected", "disconnected");
  $("token").value = "";
  showTokenForm("logged out");
}

function request(body, onReply) {
  const reqId = state.nextReqId++;
  if (onReply) state.pending.set(reqId, onReply);
  return { ...body, req_id: reqId };
}

function send(messages) {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) return false;
  state.ws.send(JSON.stringify(messages.length === 1 ? messages[0] : messages));
  return true;
}

function dispatch(m) {
  if (m.type === "event") {
    onEvent(m);
    return;
  }
  if (m.type === "moved" && state.pendingSubmit) {
    // A cluster's main port that cannot reach the plan's shard owner now moves the session instead.
    state.pending.delete(state.pendingSubmit);
    state.pendingSubmit = 0;
    $("submit-error").textContent = `not submitted: shard ${m.shard || 0} is served at ${m.url || "(nobody yet)"} and could `
      + "not be reached from here; submit again in a moment";
    return;
  }
  const callback = m.req_id ? state.pending.get(m.req_id) : undefined;
  if (callback) {
    state.pending.delete(m.req_id);
    callback(m);
  } else if (m.type === "error") {
    console.warn("coordinator error", m.code, m.message);
  }
}

// ------------------------------------------------------------------ rendering schedule

// Marks parts of the page to redraw; one redraw per animation frame at most, RENDER_EVERY_MS apart.
function invalidate(...parts) {
  for (const p of parts) state.dirty.add(p);
  if (state.renderQueued) return;
  state.renderQueued = true;
  const wait = Math.max(0, state.lastRender + RENDER_EVERY_MS - performance.now());
  const frame = () => requestAnimationFrame(flush);
  if (wait > 0) setTimeout(frame, wait);
  else frame();
}

function flush() {
  state.renderQueued = false;
  state.lastRender = performance.now();
  state.renders += 1;
  const dirty = state.dirty;
  state.dirty = new Set();
  if (dirty.has("plans")) renderPlans();
  if (dirty.has("plans") || dirty.has("counts")) renderCounts();
  if (dirty.has("queue") || dirty.has("counts")) renderQueue();
  if (dirty.has("workers")) renderWorkers();
  if (dirty.has("detail") || dirty.has("plans")) renderDetail();
  renderPlaceholders();
}

// ------------------------------------------------------------------ data

const LIVE_FIELDS = ["state", "worker_id", "attempt", "last_seq", "waiting_reason", "receipt"];

function filterActive() {
  const f = state.filter;
  return Boolean(f.states.length || f.op || f.owner || f.id_contains);
}

// New plans are shown live only on the newest page of the unfiltered list (elsewhere: by the next listing).
function showsNewPlans() {
  return state.cursors.length === 1 && !filterActive();
}

// The listing of the page shown: its filter, its cursor, one page of rows (never every plan).
function listingRequest() {
  const seq = ++state.listingSeq;
  const f = state.filter;
  const body = { type: "list_plans", limit: state.pageSize, cursor: state.cursors[state.cursors.length - 1] };
  if (f.states.length) body.states = f.states;
  if (f.op) body.op = f.op;
  if (f.owner) body.owner = f.owner;
  if (f.id_contains) body.id_contains = f.id_contains;
  state.lastLearn = performance.now();
  return request(body, (reply) => onPlans(reply, seq));
}

function refreshPlans() {
  send([listingRequest()]);
}

// A listing soon, to learn plans met only in events (their op): at most one per LEARN_EVERY_MS.
function refreshPlansSoon() {
  if (state.learnTimer) return;
  const wait = Math.max(0, state.lastLearn + LEARN_EVERY_MS - performance.now());
  state.learnTimer = setTimeout(() => {
    state.learnTimer = null;
    refreshPlans();
  }, wait);
}

// A live plan off the page: followed for the counts until it ends (the oldest dropped past MAX_TRACKED).
function track(plan) {
  state.tracked.set(plan.id, plan);
  if (state.tracked.size > MAX_TRACKED) state.tracked.delete(state.tracked.keys().next().value);
}

// The page's rows with `plan` first (the newest), cut to one page; the rows pushed off are tracked.
function prependRow(plan) {
  const rows = new Map([[plan.id, plan]]);
  for (const [id, p] of state.rows) {
    if (rows.has(id)) continue;
    if (rows.size < state.pageSize) rows.set(id, p);
    else if (!TERMINAL.has(p.state)) track(p);
  }
  state.rows = rows;
}

function planRecord(id) {
  return state.rows.get(id) || state.tracked.get(id);
}

function onPlans(reply, seq) {
  if (seq !== state.listingSeq) return; // a newer listing (another page or filter) was asked for since
  if (reply.type === "error") {
    $("filter-error").textContent = `${reply.code}: ${reply.message}`;
    return;
  }
  if (reply.type !== "plans") return;
  $("filter-error").textContent = "";
  const rows = new Map();
  if (showsNewPlans()) {
    // Plans submitted from this page a moment ago may not be in an older snapshot yet.
    for (const [id, p] of state.rows) if (p.local && !(reply.plans || []).some((q) => q.id === id)) rows.set(id, p);
  }
  for (const p of reply.plans || []) {
    const known = planRecord(p.id);
    const rec = { ...p, last_seq: p.last_seq || 0 };
    if (known && (known.last_seq || 0) > rec.last_seq) {
      for (const k of LIVE_FIELDS) if (known[k] !== undefined) rec[k] = known[k]; // events newer than the snapshot
    }
    if (known && known.local) rec.local = true;
    state.tracked.delete(p.id);
    rows.set(p.id, rec);
  }
  for (const [id, p] of state.rows) if (!rows.has(id) && !TERMINAL.has(p.state)) track(p);
  state.rows = rows;
  state.queue = reply.queue || [];
  state.waiting = { ...(reply.waiting || {}) };
  state.counts = reply.counts || {};
  state.queueKnown = state.queue.length > 0 || !state.counts.queued;
  state.total = reply.total || 0;
  state.nextCursor = reply.next_cursor || "";
  state.plansLoaded = true;
  invalidate("plans", "queue", "counts");
}

function onWorkers(reply) {
  if (reply.type !== "workers") return;
  state.workers = reply.workers || [];
  state.summary = reply.summary || "";
  state.workersLoaded = true;
  sampleWorkers(Date.now());
  invalidate("workers");
}

// The autoscaler's last word (an admin's fleet event, plan_id ""): a decision or a failed provider call.
function showAutoscale(d) {
  const line = $("autoscale");
  if (!line) return;
  line.hidden = false;
  line.dataset.action = d.action || "";
  line.className = d.action === "provider_failed" ? "error" : "muted";
  const names = d.workers && d.workers.length ? ` (${d.workers.join(", ")})` : "";
  line.textContent = d.action === "provider_failed"
    ? `autoscaler: ${d.provider} provider failed to ${d.call} ${d.workers.length} worker(s) for ${d.pool}: ` +
      `${d.error} (failure ${d.failures}; retry in ${d.retry_in_s} s)`
    : `autoscaler: ${d.action} ${d.pool} ${d.current} → ${d.desired} workers${names}, ${d.ongoing} plans ongoing`;
}

function leaveQueue(id) {
  if (id in state.waiting) delete state.waiting[id];
  const at = state.queue.indexOf(id);
  if (at >= 0) {
    state.queue.splice(at, 1);
    invalidate("queue");
  }
}

// One event: records and counts change here; the page is redrawn later, once for many events (invalidate).
function onEvent(ev) {
  if (ev.kind === "autoscale" && !ev.plan_id) {
    showAutoscale(ev.data || {});
    return;
  }
  const now = Date.now();
  const id = ev.plan_id;
  const key = `${id}:${ev.seq}`;
  if (!state.eventTimes.has(key)) {
    state.eventTimes.set(key, now);
    if (state.eventTimes.size > MAX_SEEN) state.eventTimes.delete(state.eventTimes.keys().next().value);
  }
  let plan = planRecord(id);
  if (ev.seq === 1 && ev.kind === "queued" && !state.seenAt.has(id)) {
    state.seenAt.set(id, now); // a new plan: its submit->result clock starts
    if (state.seenAt.size > MAX_SEEN) state.seenAt.delete(state.seenAt.keys().next().value);
    if (!plan || !plan.last_seq) {
      state.counts.queued = (state.counts.queued || 0) + 1;
      invalidate("counts");
    }
  }
  if (!plan) {
    // Its state before this event is known only when this is its first event; else the counts
    // wait for the next listing.
    plan = { id, op: "", state: "queued", attempt: 0, last_seq: 0, guessed: ev.seq !== 1 };
    if (showsNewPlans() && !TERMINAL.has(KIND_STATE[ev.kind])) {
      prependRow(plan);
      refreshPlansSoon(); // learn its op from a snapshot (coalesced: one listing for many new plans)
    } else {
      track(plan);
    }
  }
  const onPage = state.rows.get(id) === plan;
  // Only events newer than what the record shows move it (a replay for the event pane must not).
  const newer = ev.seq > (plan.last_seq || 0);
  if (newer) plan.last_seq = ev.seq;
  const next = KIND_STATE[ev.kind];
  if (newer && next && !TERMINAL.has(plan.state)) {
    if (!plan.guessed && plan.state !== next) {
      // Live counts between listings: each transition moves one plan from a state to another.
      state.counts[plan.state] = Math.max(0, (state.counts[plan.state] || 0) - 1);
      state.counts[next] = (state.counts[next] || 0) + 1;
      invalidate("counts");
    }
    const data = ev.data || {};
    if (TERMINAL.has(next)) noteOutcome(id, next, now, data.receipt);
    plan.state = next;
    if (data.worker_id) plan.worker_id = data.worker_id;
    if (ev.kind === "leased" && data.attempt) plan.attempt = data.attempt;
    if (ev.kind === "waiting") {
      plan.waiting_reason = data.reason;
      if (data.reason) state.waiting[id] = data.reason;
      invalidate("queue");
    }
    if (TERMINAL.has(next) && data.receipt) plan.receipt = data.receipt; // energy and carbon (PROTOCOL.md §Receipt)
    if (next === "queued") {
      if (state.queueKnown && !state.queue.includes(id) && state.queue.length < state.pageSize) {
        state.queue.push(id);
        invalidate("queue");
      }
    } else {
      leaveQueue(id);
    }
    if (TERMINAL.has(next) && !onPage) state.tracked.delete(id); // counted: nothing more to follow
    if (onPage) invalidate("plans");
    if (onPage && ev.kind === "requeued") refreshPlansSoon();
  }
  if (id === state.selected && ev.seq > state.selectedSeq) {
    state.selectedSeq = ev.seq;
    appendEvent(ev);
    if (TERMINAL.has(ev.kind) || ev.kind === "leased" || ev.kind === "requeued" || ev.kind === "running") {
      fetchResult(id); // the detail's record (attempts, times, result) follows the plan
    }
    invalidate("detail");
  }
}

function follow(planId) {
  state.selected = planId;
  state.selectedSeq = 0;
  if (planInLink() !== planId) history.replaceState(null, "", "#" + new URLSearchParams({ plan: planId }));
  $("events").tBodies[0].replaceChildren();
  $("events-plan").textContent = planId;
  $("plan-result").hidden = true;
  state.detail = null;
  $("detail-error").textContent = "";
  $("detail-close").hidden = false;
  // Replays what the coordinator still holds, then stays live (the all-subscription already is).
  send([request({ type: "subscribe", plan_ids: [planId], from_seq: 0 }, (reply) => {
    if (reply.type === "error" && planId === state.selected) $("detail-error").textContent = `${reply.code}: ${reply.message}`;
  })]);
  fetchResult(planId); // the record: owner, attempts, times, and the result once it ended
  invalidate("plans", "detail");
}

function closeDetail() {
  state.selected = null;
  state.detail = null;
  if (planInLink()) history.replaceState(null, "", location.pathname + location.search);
  $("events").tBodies[0].replaceChildren();
  $("events-plan").textContent = "(select a plan)";
  $("plan-result").hidden = true;
  $("detail-close").hidden = true;
  invalidate("plans", "detail");
}

function cancelSelected() {
  const planId = state.selected;
  if (!planId) return;
  $("detail-error").textContent = "";
  const ok = send([request({ type: "cancel", plan_id: planId }, (reply) => {
    if (reply.type === "error") $("detail-error").textContent = `cancel: ${reply.code}: ${reply.message}`;
    else if (reply.type === "plan" && reply.plan && reply.plan.id === state.selected) {
      state.detail = reply.plan;
      invalidate("detail");
    }
  })]);
  if (!ok) $("detail-error").textContent = "not connected";
}

function clockTime(ms) {
  if (!ms) return "-";
  const d = new Date(ms);
  return d.toLocaleTimeString([], { hour12: false }) + "." + String(d.getMilliseconds()).padStart(3, "0");
}

// The selected plan beside the list: its record (get_plan) merged with the events seen live.
function renderDetail() {
  const planId = state.selected;
  const fields = $("detail-fields");
  const attemptsBody = $("detail-attempts").tBodies[0];
  $("detail").dataset.planId = planId || "";
  if (!planId) {
    fields.replaceChildren();
    attemptsBody.replaceChildren();
    $("detail-cancel").hidden = true;
    return;
  }
  const row = planRecord(planId) || {};
  const rec = state.detail && state.detail.id === planId ? state.detail : {};
  const planState = TERMINAL.has(rec.state) ? rec.state : row.state || rec.state || "?";
  $("detail").dataset.state = planState;
  $("detail-cancel").hidden = TERMINAL.has(planState);
  const times = { queued: null, running: null, ended: null };
  const attempts = new Map(); // attempt -> {worker, leased, outcome, reason}
  for (const tr of $("events").tBodies[0].rows) {
    const kind = tr.dataset.kind;
    const at = Number(tr.dataset.seen) || null;
    let data = {};
    try { data = JSON.parse(tr.dataset.json || "{}") || {}; } catch (err) { data = {}; }
    if (kind === "queued" && !times.queued) times.queued = at;
    if (kind === "running") times.running = at;
    if (TERMINAL.has(kind)) times.ended = at;
    if (kind === "leased" && data.attempt) {
      attempts.set(data.attempt, { worker: data.worker_id, leased: at, outcome: "leased", reason: "" });
    }
    const a = attempts.get(Number(tr.dataset.attempt));
    if (a && kind === "running") a.outcome = "running";
    if (a && TERMINAL.has(kind)) a.outcome = kind;
  }
  for (const h of rec.history || []) {
    const a = attempts.get(h.attempt) || { worker: h.worker_id, leased: null };
    attempts.set(h.attempt, { ...a, worker: h.worker_id || a.worker, outcome: h.outcome, reason: h.reason || "" });
  }
  if (rec.attempt && !attempts.has(rec.attempt)) {
    attempts.set(rec.attempt, { worker: rec.worker_id, leased: null, outcome: rec.state, reason: "" });
  }
  const error = rec.error || row.error;
  const pairs = [
    ["id", planId],
    ["op", rec.op || row.op || "…"],
    ["state", planState],
    ["owner", rec.owner || "-"],
    ["worker", rec.worker_id || row.worker_id || "-"],
    ["attempt", rec.attempt || row.attempt || 0],
    ["priority", rec.priority || 0],
    ["tags", ((rec.requirements || {}).tags || []).join(", ") || "-"],
    ["queued (seen)", clockTime(times.queued)],
    ["running (seen)", clockTime(times.running)],
    ["ended", rec.ended_at ? clockTime(rec.ended_at * 1000) : clockTime(times.ended)],
  ];
  if (times.queued && (times.ended || rec.ended_at)) {
    const end = times.ended || rec.ended_at * 1000;
    pairs.push(["submit → result", `${((end - times.queued) / 1000).toFixed(3)} s`]);
  }
  const reason = row.waiting_reason || state.waiting[planId] || rec.waiting_reason;
  if (planState === "queued" && reason) pairs.push(["waiting", reason]);
  const receipt = rec.receipt || row.receipt;
  if (receipt) pairs.push(["energy · gCO2e", receiptText(receipt)]);
  if (error) pairs.push(["error", `${error.code}: ${error.message}`]);
  const nodes = [];
  for (const [k, v] of pairs) {
    const dd = el("dd", v);
    dd.dataset.field = k;
    nodes.push(el("dt", k), dd);
  }
  fields.replaceChildren(...nodes);
  const rows = [...attempts.entries()].sort((a, b) => a[0] - b[0]).map(([n, a]) => {
    const tr = el("tr");
    tr.dataset.attempt = n;
    tr.append(el("td", n), el("td", a.worker || "-", "mono"), el("td", clockTime(a.leased)),
      el("td", a.outcome || "-"), el("td", a.reason || ""));
    return tr;
  });
  attemptsBody.replaceChildren(...rows);
}

// The result of one plan, on demand: listings never carry result bodies.
function fetchResult(planId) {
  send([request({ type: "get_plan", plan_id: planId }, (reply) => {
    if (reply.type === "error" && planId === state.selected) {
      $("detail-error").textContent = `${reply.code}: ${reply.message}`;
      return;
    }
    if (reply.type !== "plan" || !reply.plan || reply.plan.id !== state.selected) return;
    const p = reply.plan;
    state.detail = p;
    invalidate("detail");
    if (!TERMINAL.has(p.state)) return; // the result, once it ends
    const out = $("plan-result");
    out.dataset.state = p.state;
    let text = p.error ? `${p.error.code}: ${p.error.message}` : JSON.stringify(p.result === undefined ? null : p.result);
    if (text.length > MAX_RESULT_CHARS) text = text.slice(0, MAX_RESULT_CHARS) + ` … (${text.length} characters)`;
    out.textContent = `${p.state}: ${text}`;
    out.hidden = false;
  })]);
}

function submitPlan(event) {
  event.preventDefault();
  const error = $("submit-error");
  error.textContent = "";
  const op = $("op").value.trim();
  let args = null;
  const text = $("args").value.trim();
  if (text) {
    try {
      args = JSON.parse(text);
    } catch (err) {
      error.textContent = `args is not valid JSON: ${err.message}`;
      return;
    }
  }
  const tags = $("tags").value.split(",").map((t) => t.trim()).filter(Boolean);
  const msg = request({ type: "submit", op, args, requirements: { tags }, subscribe: true }, (reply) => {
    state.pendingSubmit = 0;
    if (reply.type === "error") {
      error.textContent = `${reply.code}: ${reply.message}`;
      return;
    }
    if (reply.type !== "accepted") {
      error.textContent = `unexpected answer to submit: ${reply.type}`;
      return;
    }
    const known = planRecord(reply.plan_id);
    // Its state comes from its events (the first one counts it as queued).
    const plan = known || { id: reply.plan_id, state: "queued", attempt: 0, last_seq: 0 };
    plan.op = op;
    plan.local = true;
    if (!known) {
      if (showsNewPlans()) prependRow(plan);
      else track(plan);
    }
    follow(plan.id);
    refreshPlansSoon(); // the counts and the queue now include it
  });
  if (!send([msg])) error.textContent = "not connected";
  else state.pendingSubmit = msg.req_id;
}

// ------------------------------------------------------------------ filter and pages

function readFilter() {
  const chosen = $("filter-state").value;
  return {
    states: chosen === "unfinished" ? UNFINISHED : chosen ? [chosen] : [],
    op: $("filter-op").value.trim(),
    owner: $("filter-owner").value.trim(),
    id_contains: $("filter-id").value.trim(),
  };
}

// The filter or the page size changed: the newest page of what now matches.
function applyFilter() {
  clearTimeout(state.filterTimer);
  state.filterTimer = null;
  state.filter = readFilter();
  state.pageSize = Number($("page-size").value) || DEFAULT_PAGE_SIZE;
  state.cursors = [""];
  state.nextCursor = "";
  refreshPlans();
  invalidate("plans", "queue", "counts");
}

function applyFilterSoon() {
  clearTimeout(state.filterTimer);
  state.filterTimer = setTimeout(applyFilter, FILTER_DELAY_MS);
}

function olderPage() {
  if (!state.nextCursor) return;
  state.cursors.push(state.nextCursor);
  state.nextCursor = "";
  refreshPlans();
}

function newerPage() {
  if (state.cursors.length <= 1) return;
  state.cursors.pop();
  refreshPlans();
}

// A click on a plan id (a link to #plan=<id>) or a plan row opens its detail; the link works without script too.
function onPlanClick(event) {
  const target = event.target.closest("[data-plan-id]");
  if (!target || event.button !== 0 || event.metaKey || event.ctrlKey || event.shiftKey) return;
  event.preventDefault();
  follow(target.dataset.planId);
}

function planLink(id) {
  const a = el("a", id, "mono plan-link");
  a.href = "#" + new URLSearchParams({ plan: id });
  return a;
}

// ------------------------------------------------------------------ rendering

function age(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  return seconds < 60 ? `${seconds.toFixed(1)} s ago` : `${Math.round(seconds / 60)} min ago`;
}

function workerState(w) {
  if (w.alive) return "alive";
  return w.connected ? "suspect" : "dead";
}

function gib(bytes) {
  return `${(bytes / 2 ** 30).toFixed(0)} GiB`;
}

function renderWorkers() {
  $("summary").textContent = state.summary;
  const body = $("workers").tBodies[0];
  const rows = [];
  for (const w of state.workers) {
    const caps = w.capabilities || {};
    const load = w.load || {};
    const tr = el("tr");
    tr.dataset.workerId = w.id;
    tr.append(el("td", w.id, "mono"));
    const st = el("td");
    const ws = workerState(w);
    st.append(el("span", ws, `state state-${ws}`));
    if (w.draining) st.append(" ", el("span", "draining", "state state-draining"));
    tr.append(st);
    tr.append(el("td", (caps.tags || []).join(", ") || "-"));
    tr.append(el("td", caps.accelerator || "cpu"));
    const gpus = caps.gpus || [];
    const gpuUse = w.gpu_use || [];
    const gpusUsed = gpuUse.filter((n) => n > 0).length;
    // Each device's health from the worker's load (docs/OPERATIONS.md §GPU health): a quarantine says why.
    const health = new Map((load.devices || []).map((d) => [d.index || 0, d]));
    const healthText = (h) => !h ? "" : (h.state && h.state !== "ok")
      ? ` ⚠ ${h.state}: ${h.reason || ""}` : ` ${Math.round(h.temperature_c || 0)} °C`;
    tr.append(el("td", gpus.length
      ? gpus.map((g, i) => `${g.name} (${gib(g.memory_bytes || 0)})${gpuUse[i] ? " ●" : ""}${healthText(health.get(i))}`)
        .join(", ") + ` — ${gpusUsed} used, ${gpus.length - gpusUsed} free`
      : "-"));
    const max = caps.max_concurrency === undefined ? 1 : caps.max_concurrency;
    const leases = w.leases || 0;
    const loadTd = el("td");
    const bar = el("span", null, "loadbar" + (max && leases >= max ? " full" : ""));
    const fill = el("span");
    fill.style.width = `${max ? Math.min(100, (100 * leases) / max) : 100}%`;
    bar.append(fill);
    loadTd.append(bar, `${leases}/${max}`);
    if (load.queued) loadTd.append(` (+${load.queued} queued)`);
    tr.append(loadTd);
    const energy = [];
    if (load.uj_per_token) energy.push(`${load.uj_per_token.toFixed(0)} µJ/token`);
    if (load.power_w) energy.push(`${load.power_w.toFixed(0)} W`);
    tr.append(el("td", energy.join(", ") || "-"));
    const carbon = load.zone_intensity_g_per_kwh
      ? `${load.zone_intensity_g_per_kwh.toFixed(0)} g/kWh${caps.carbon_zone ? " (" + caps.carbon_zone + ")" : ""}`
      : caps.carbon_zone || "-";
    tr.append(el("td", carbon));
    const engine = load.engine_running || load.engine_waiting || load.kv_cache_usage
      ? `${load.engine_running || 0} running, ${load.engine_waiting || 0} waiting, KV ${Math.round(100 * (load.kv_cache_usage || 0))}%`
      : "-";
    tr.append(el("td", engine));
    tr.append(el("td", age(w.last_beat_age_s)));
    const act = el("td");
    const button = el("button", w.draining ? "Undrain" : "Drain", "small worker-action");
    button.type = "button";
    button.dataset.action = w.draining ? "undrain" : "drain";
    button.addEventListener("click", () => drainWorker(w.id, !w.draining));
    act.append(button);
    tr.append(act);
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  renderPlaceholders();
}

// A plan's receipt in one cell: "12.3 J · 0.41 g" ("~" before an estimate); "-" without one.
function receiptText(r) {
  if (!r) return "-";
  const j = r.joules || 0;
  const energy = j >= 1e4 ? `${(j / 1e3).toPrecision(3)} kJ` : j >= 0.1 || j === 0 ? `${j.toFixed(1)} J` : `${j.toPrecision(2)} J`;
  return `${r.estimated ? "~" : ""}${energy} · ${(r.co2e_g || 0).toPrecision(2)} g`;
}

// The total over the plans listed: energy and gCO2e of those with a receipt.
function renderFootprint() {
  const out = $("plans-footprint");
  if (!out) return;
  let joules = 0, grams = 0, n = 0, estimated = 0;
  for (const p of state.rows.values()) {
    if (!p.receipt) continue;
    n += 1;
    joules += p.receipt.joules || 0;
    grams += p.receipt.co2e_g || 0;
    if (p.receipt.estimated) estimated += 1;
  }
  out.textContent = n ? `total over the ${n} finished plans listed: ${receiptText({ joules, co2e_g: grams })}` +
    (estimated ? ` (${estimated} estimated)` : "") : "";
}

// One page of rows at most (pageSize), rebuilt at most once per redraw.
function renderPlans() {
  const body = $("plans").tBodies[0];
  const rows = [];
  for (const p of state.rows.values()) {
    if (rows.length >= state.pageSize) break;
    const tr = el("tr");
    tr.dataset.planId = p.id;
    tr.dataset.state = p.state;
    if (p.id === state.selected) tr.className = "selected";
    const idCell = el("td");
    idCell.append(planLink(p.id));
    tr.append(idCell);
    tr.append(el("td", p.op || "…"));
    const st = el("td");
    st.append(el("span", p.state, `state state-${p.state}`));
    tr.append(st);
    tr.append(el("td", p.worker_id || "-", "mono"));
    tr.append(el("td", p.attempt || 0));
    tr.append(el("td", p.last_seq || 0));
    tr.append(el("td", receiptText(p.receipt)));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  renderFootprint();
}

// The state counts (a fixed order), the page's place in the listing and the paging buttons.
function renderCounts() {
  // A fixed order (the coordinator's map follows the plans it met first, which changes).
  const order = [...STATE_ORDER, ...Object.keys(state.counts).filter((k) => !STATE_ORDER.includes(k)).sort()];
  const counts = order.filter((k) => state.counts[k]).map((k) => `${state.counts[k]} ${k}`);
  $("plan-counts").textContent = counts.length ? "plans: " + counts.join(", ") : "";
  const page = state.cursors.length;
  const shown = Math.min(state.rows.size, state.pageSize);
  const info = $("page-info");
  info.dataset.page = page;
  info.dataset.total = state.total;
  info.textContent = `page ${page}: ${shown} of ${state.total} ${filterActive() ? "matching " : ""}plans`;
  $("page-newer").disabled = page <= 1;
  $("page-older").disabled = !state.nextCursor;
}

function renderQueue() {
  const queue = $("queue");
  const items = [];
  for (const id of state.queue) {
    if (items.length >= state.pageSize) break;
    const li = el("li");
    li.dataset.planId = id;
    const p = planRecord(id);
    li.append(planLink(id));
    if (p && p.op) li.append(el("span", ` (${p.op})`, "muted"));
    const reason = state.waiting[id] || (p && p.waiting_reason);
    if (reason) li.append(el("span", reason, "reason"));
    if (id === state.selected) li.className = "selected";
    items.push(li);
  }
  queue.replaceChildren(...items);
  // The queue list is capped (the listing's limit); the depth is the count of queued plans.
  const depth = Math.max(state.counts.queued || 0, state.queue.length);
  $("queue-depth").textContent = !state.queueKnown
    ? `(${depth} waiting; the order is each shard's own, not shown on a cluster's main port: filter the list by state)`
    : depth > items.length ? `(${depth} waiting; the first ${items.length} shown)` : `(${depth})`;
  $("queue-depth").dataset.depth = depth;
}

function appendEvent(ev) {
  const body = $("events").tBodies[0];
  const tr = el("tr");
  tr.dataset.seq = ev.seq;
  tr.dataset.kind = ev.kind;
  if (ev.ephemeral) tr.className = "ephemeral";
  const seen = state.eventTimes.get(`${ev.plan_id}:${ev.seq}`);
  tr.dataset.attempt = ev.attempt || 0;
  if (seen) tr.dataset.seen = seen;
  if (ev.data && typeof ev.data === "object" && !Array.isArray(ev.data)) {
    const small = JSON.stringify(ev.data);
    if (small.length < 1000) tr.dataset.json = small;
  }
  tr.append(el("td", ev.seq), el("td", seen ? clockTime(seen) : "-", "mono"), el("td", ev.kind));
  tr.append(el("td", ev.data === undefined || ev.data === null ? "" : JSON.stringify(ev.data), "data mono"));
  body.append(tr);
  while (body.rows.length > MAX_EVENT_ROWS) body.deleteRow(0);
}

// ------------------------------------------------------------------ operator actions

// Drain (no new plans; running ones finish) or undrain a worker: admin only (others get forbidden).
function drainWorker(workerId, drain) {
  $("worker-error").textContent = "";
  const type = drain ? "drain_worker" : "undrain_worker";
  const ok = send([request({ type, worker_id: workerId }, (reply) => {
    if (reply.type === "error") {
      $("worker-error").textContent = `${drain ? "drain" : "undrain"} ${workerId}: ${reply.code}: ${reply.message}`;
      return;
    }
    send([request({ type: "list_workers" }, onWorkers)]);
  })]);
  if (!ok) $("worker-error").textContent = "not connected";
}

// ------------------------------------------------------------------ operator actions

// Drain (no new plans; running ones finish) or undrain a worker: admin only (others get forbidden).
function drainWorker(workerId, drain) {
  $("worker-error").textContent = "";
  const type = drain ? "drain_worker" : "undrain_worker";
  const ok = send([request({ type, worker_id: workerId }, (reply) => {
    if (reply.type === "error") {
      $("worker-error").textContent = `${drain ? "drain" : "undrain"} ${workerId}: ${reply.code}: ${reply.message}`;
      return;
    }
    send([request({ type: "list_workers" }, onWorkers)]);
  })]);
  if (!ok) $("worker-error").textContent = "not connected";
}

// ------------------------------------------------------------------ charts

// A plan ended (live): its outcome, its latency when its start was seen, and its receipt's energy.
function noteOutcome(planId, outcome, now, receipt) {
  const c = state.charts;
  c.outcomes[outcome].add(now);
  if (receipt) { // the same figures as the plan's receipt (a row's energy cell), by the bucket of its end
    c.joules.add(now, receipt.joules || 0);
    c.grams.add(now, receipt.co2e_g || 0);
    c.receipts += 1;
    c.joulesSeen += receipt.joules || 0;
  }
  const start = state.seenAt.get(planId);
  if (start === undefined) return; // first heard of mid-life: its submit time is unknown here
  state.seenAt.delete(planId);
  const b = Math.floor(now / RATE_BUCKET_MS) * RATE_BUCKET_MS;
  if (!c.latencies.has(b)) c.latencies.set(b, []);
  c.latencies.get(b).push((now - start) / 1000);
}

function sampleWorkers(now) {
  const c = state.charts;
  const { TimeSeries } = window.fleetCharts;
  for (const w of state.workers) {
    const caps = w.capabilities || {};
    const max = caps.max_concurrency === undefined ? 1 : caps.max_concurrency;
    const leases = w.leases || 0;
    if (!c.inflight.has(w.id)) c.inflight.set(w.id, new TimeSeries(HOUR_MS));
    if (!c.load.has(w.id)) c.load.set(w.id, new TimeSeries(HOUR_MS));
    c.inflight.get(w.id).add(now, leases);
    c.load.get(w.id).add(now, max ? (100 * leases) / max : 0);
  }
}

function joulesText(j) {
  return j >= 1e4 ? `${(j / 1e3).toPrecision(3)} kJ` : `${j.toFixed(1)} J`;
}

function drawCharts() {
  const c = state.charts;
  const { drawChart, percentile } = window.fleetCharts;
  const now = Date.now();
  // The last hour, or since the page opened (at least a minute) while it has seen less: readable at once.
  const opts = { now, windowMs: Math.min(HOUR_MS, Math.max(60 * 1000, now - c.since)) };
  c.queue.add(now, Math.max(state.counts.queued || 0, state.queue.length));
  const scale = 1000 / RATE_BUCKET_MS;
  drawChart($("chart-rate"), ["succeeded", "failed", "cancelled"].map((k, i) => ({
    name: k, color: ["#1f8a4c", "#c53030", "#6b7385"][i], points: c.outcomes[k].points(now, scale, c.since),
  })), { ...opts, unit: "plans/s" });
  drawChart($("chart-queue"), [{ name: "queued", points: c.queue.points, color: "#b7791f" }], { ...opts, unit: "plans" });
  const p50 = [];
  const p99 = [];
  for (const [b, values] of [...c.latencies.entries()].sort((x, y) => x[0] - y[0])) {
    if (b < now - HOUR_MS) {
      c.latencies.delete(b);
      continue;
    }
    const t = Math.min(b + RATE_BUCKET_MS, now);
    p50.push([t, percentile(values, 0.5)]);
    p99.push([t, percentile(values, 0.99)]);
  }
  drawChart($("chart-latency"), [{ name: "p50", points: p50 }, { name: "p99", points: p99, color: "#c53030" }],
    { ...opts, unit: "seconds" });
  const perWorker = (m) => [...m.entries()].filter(([, s]) => (s.trim(now), s.points.length)).map(([id, s]) => ({ name: id, points: s.points }));
  drawChart($("chart-inflight"), perWorker(c.inflight), { ...opts, unit: "plans" });
  drawChart($("chart-load"), perWorker(c.load), { ...opts, unit: "%" });
  // Receipts per 10 s bucket, as a rate per minute: J x 6 / 3600 = Wh/min; g x 6 = g/min.
  const perMinute = 60 * 1000 / RATE_BUCKET_MS;
  drawChart($("chart-energy"), [
    { name: "Wh/min", points: c.joules.points(now, perMinute / 3600, c.since), color: "#b7791f" },
    { name: "gCO2e/min", points: c.grams.points(now, perMinute, c.since), color: "#4a5568" },
  ], opts);
  const note = $("energy-note");
  note.dataset.receipts = c.receipts;
  note.dataset.joules = c.joulesSeen;
  note.textContent = c.receipts
    ? `(receipts of ${c.receipts} plans ended since this page opened: ${joulesText(c.joulesSeen)})`
    : "(no receipts yet: a worker measures energy with NVML, or estimates it with --power-watts or --uj-per-token)";
}

// ------------------------------------------------------------------ start

document.addEventListener("DOMContentLoaded", () => {
  $("submit-form").addEventListener("submit", submitPlan);
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.token = $("token").value;
    $("token").value = "";
    state.everConnected = false;
    sessionStorage.setItem("fleetwire-token", state.token);
    connect();
  });
  $("logout").addEventListener("click", logOut);
  $("detail-cancel").addEventListener("click", cancelSelected);
  $("detail-close").addEventListener("click", closeDetail);
  $("plans").tBodies[0].addEventListener("click", onPlanClick);
  $("queue").addEventListener("click", onPlanClick);
  $("filter-form").addEventListener("submit", (event) => {
    event.preventDefault();
    applyFilter();
  });
  for (const id of ["filter-op", "filter-owner", "filter-id"]) $(id).addEventListener("input", applyFilterSoon);
  for (const id of ["filter-state", "page-size"]) $(id).addEventListener("change", applyFilter);
  $("page-size").replaceChildren(...PAGE_SIZES.map((n) => {
    const option = el("option", n);
    option.value = n;
    option.selected = n === DEFAULT_PAGE_SIZE;
    return option;
  }));
  $("page-older").addEventListener("click", olderPage);
  $("page-newer").addEventListener("click", newerPage);
  state.charts = makeCharts();
  drawCharts();
  setInterval(drawCharts, CHARTS_EVERY_MS);
  window.addEventListener("hashchange", onHashChange); // a token link pasted into this tab, or a plan link
  invalidate("plans", "queue", "counts", "workers");
  if (refuseTokenInLink()) {
    setStatus("disconnected", "disconnected");
    return; // not connected until the form is used
  }
  const linked = planInLink();
  if (linked) state.selected = linked; // its detail opens once connected
  state.token = sessionStorage.getItem("fleetwire-token") || "";
  connect();
});
