// fleetwire dashboard: a client session over the JSON subprotocol (docs/PROTOCOL.md).
//
// The token travels as an offered subprotocol `fleetwire.bearer.<base64url token>` (browsers
// cannot set an Authorization header); the coordinator never selects it. It comes from the login
// form and is kept in sessionStorage (this tab only, gone when it closes), never in the URL, so it
// stays out of the browser's history. A legacy #token=... fragment is still read once, moved to
// sessionStorage and cleared from the address bar.
//
// Live data: `subscribe(all, from_seq=MAX)` makes the coordinator push every future event of every
// plan this token may see (an admin token: all plans) without replaying history; `list_plans` and
// `list_workers` give snapshots, polled every few seconds. Everything is rendered with textContent,
// never innerHTML, so nothing a worker or a client sends can inject markup.
"use strict";

const JSON_SUBPROTOCOL = "fleetwire.v1.json";
const BEARER_PREFIX = "fleetwire.bearer.";
const NO_REPLAY = Number.MAX_SAFE_INTEGER; // from_seq past any event: live events only
const WORKERS_EVERY_MS = 2000;
const PLANS_EVERY_MS = 5000;
const MAX_PLANS = 200;
const MAX_EVENT_ROWS = 500;
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
  plans: new Map(), // plan_id -> {id, op, state, worker_id, attempt, last_seq, waiting_reason}
  queue: [],
  counts: {},
  workers: [],
  summary: "",
  selected: null,
  selectedSeq: 0,
  timers: [],
  refreshSoon: null,
  reconnectDelay: 500,
  everConnected: false,
};

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

function tokenFromFragment() {
  const params = new URLSearchParams(location.hash.replace(/^#/, ""));
  return params.get("token");
}

// ------------------------------------------------------------------ connection

function setStatus(text, kind) {
  const pill = $("conn-status");
  pill.textContent = text;
  pill.dataset.state = kind;
  pill.className = "pill " + (kind === "connected" ? "pill-on" : kind === "connecting" ? "pill-wait" : "pill-off");
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
      request({ type: "list_plans", limit: MAX_PLANS }, onPlans),
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
  const callback = m.req_id ? state.pending.get(m.req_id) : undefined;
  if (callback) {
    state.pending.delete(m.req_id);
    callback(m);
  } else if (m.type === "error") {
    console.warn("coordinator error", m.code, m.message);
  }
}

// ------------------------------------------------------------------ data

function refreshPlans() {
  send([request({ type: "list_plans", limit: MAX_PLANS }, onPlans)]);
}

function refreshPlansSoon() {
  if (state.refreshSoon) return;
  state.refreshSoon = setTimeout(() => {
    state.refreshSoon = null;
    refreshPlans();
  }, 100);
}

function onPlans(reply) {
  if (reply.type !== "plans") return;
  const fresh = new Map();
  for (const p of reply.plans || []) fresh.set(p.id, { ...p, last_seq: p.last_seq || 0 });
  // Plans submitted from this page a moment ago may not be in an older snapshot yet.
  for (const [id, p] of state.plans) if (!fresh.has(id) && p.local) fresh.set(id, p);
  state.plans = fresh;
  state.queue = reply.queue || [];
  state.counts = reply.counts || {};
  renderPlans();
}

function onWorkers(reply) {
  if (reply.type !== "workers") return;
  state.workers = reply.workers || [];
  state.summary = reply.summary || "";
  renderWorkers();
}

function onEvent(ev) {
  let plan = state.plans.get(ev.plan_id);
  if (!plan) {
    plan = { id: ev.plan_id, op: "", state: "queued", attempt: 0, last_seq: 0 };
    state.plans = new Map([[ev.plan_id, plan], ...state.plans]); // newest first
    refreshPlansSoon(); // learn its op from a snapshot
  }
  // Only events newer than what the row shows move it (a replay for the event pane must not).
  const newer = ev.seq > (plan.last_seq || 0);
  if (newer) plan.last_seq = ev.seq;
  const next = KIND_STATE[ev.kind];
  if (newer && next && !TERMINAL.has(plan.state)) {
    plan.state = next;
    const data = ev.data || {};
    if (data.worker_id) plan.worker_id = data.worker_id;
    if (ev.kind === "leased" && data.attempt) plan.attempt = data.attempt;
    if (ev.kind === "waiting") plan.waiting_reason = data.reason;
    if (next === "queued" && !state.queue.includes(plan.id)) state.queue.push(plan.id);
    if (next !== "queued") state.queue = state.queue.filter((id) => id !== plan.id);
    if (ev.kind === "requeued" || TERMINAL.has(next)) refreshPlansSoon();
  }
  if (ev.plan_id === state.selected && ev.seq > state.selectedSeq) {
    state.selectedSeq = ev.seq;
    appendEvent(ev);
  }
  renderPlans();
}

function follow(planId) {
  state.selected = planId;
  state.selectedSeq = 0;
  $("events").tBodies[0].replaceChildren();
  $("events-plan").textContent = planId;
  // Replays what the coordinator still holds, then stays live (the all-subscription already is).
  send([request({ type: "subscribe", plan_ids: [planId], from_seq: 0 })]);
  renderPlans();
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
    if (reply.type === "error") {
      error.textContent = `${reply.code}: ${reply.message}`;
      return;
    }
    const known = state.plans.get(reply.plan_id);
    const plan = known || { id: reply.plan_id, state: reply.state, attempt: 0, last_seq: 0 };
    plan.op = op;
    plan.local = true;
    if (!known) state.plans = new Map([[plan.id, plan], ...state.plans]);
    follow(plan.id);
    refreshPlansSoon(); // the counts and the queue now include it
  });
  if (!send([msg])) error.textContent = "not connected";
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
    tr.append(el("td", gpus.length ? gpus.map((g) => `${g.name} (${gib(g.memory_bytes || 0)})`).join(", ") : "-"));
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
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  $("no-workers").hidden = rows.length > 0;
}

function renderPlans() {
  const body = $("plans").tBodies[0];
  const rows = [];
  let n = 0;
  for (const p of state.plans.values()) {
    if (n++ >= MAX_PLANS) break;
    const tr = el("tr");
    tr.dataset.planId = p.id;
    tr.dataset.state = p.state;
    if (p.id === state.selected) tr.className = "selected";
    tr.append(el("td", p.id, "mono"));
    tr.append(el("td", p.op || "…"));
    const st = el("td");
    st.append(el("span", p.state, `state state-${p.state}`));
    tr.append(st);
    tr.append(el("td", p.worker_id || "-", "mono"));
    tr.append(el("td", p.attempt || 0));
    tr.append(el("td", p.last_seq || 0));
    tr.addEventListener("click", () => follow(p.id));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  $("no-plans").hidden = rows.length > 0;
  const counts = Object.entries(state.counts).filter(([, v]) => v).map(([k, v]) => `${v} ${k}`);
  $("plan-counts").textContent = counts.length ? "plans: " + counts.join(", ") : "";
  const queue = $("queue");
  const items = state.queue.map((id) => {
    const li = el("li");
    li.dataset.planId = id;
    const p = state.plans.get(id);
    li.append(el("span", `${id}${p && p.op ? " (" + p.op + ")" : ""}`, "mono"));
    if (p && p.waiting_reason) li.append(el("span", p.waiting_reason, "reason"));
    return li;
  });
  queue.replaceChildren(...items);
  $("queue-depth").textContent = `(${state.queue.length})`;
}

function appendEvent(ev) {
  const body = $("events").tBodies[0];
  const tr = el("tr");
  tr.dataset.seq = ev.seq;
  tr.dataset.kind = ev.kind;
  if (ev.ephemeral) tr.className = "ephemeral";
  tr.append(el("td", ev.seq), el("td", ev.kind));
  tr.append(el("td", ev.data === undefined || ev.data === null ? "" : JSON.stringify(ev.data), "data mono"));
  body.append(tr);
  while (body.rows.length > MAX_EVENT_ROWS) body.deleteRow(0);
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
  const fromFragment = tokenFromFragment();
  if (fromFragment !== null) {
    state.token = fromFragment;
    sessionStorage.setItem("fleetwire-token", fromFragment);
    history.replaceState(null, "", location.pathname); // keep the token out of the address bar
  } else {
    state.token = sessionStorage.getItem("fleetwire-token") || "";
  }
  renderPlans();
  renderWorkers();
  connect();
});
