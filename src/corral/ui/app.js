// corral dashboard: reads /api/corral/events (server-sent events, read with fetch so that an
// API key can go in a header), falls back to polling /api/corral/state, and renders.
"use strict";

const KEY_STORE = "corral-api-key";
const STATE_LABEL = {
  not_loaded: "not loaded", loading: "loading", ready: "ready",
  draining: "draining", unloading: "unloading",
};
const REASON = {
  memory: "evicted for memory", keep_alive: "keep-alive expired",
  options_change: "reloading for new options", requested: "unloaded on request",
};
const PALETTE = ["#3b6cf6", "#14a05a", "#d98a06", "#8b5cf6", "#0ea5b7", "#e0527a", "#6d8a1f", "#c2410c"];

let apiKey = localStorage.getItem(KEY_STORE) || "";
let last = null;            // the last state document
let pressed = false;        // a pointer is down on the models table (see "wiring")
let receivedAt = 0;         // when it came (ms, performance.now())
const pending = new Map();  // model -> "load" | "unload" | "delete" while its request runs
const stateHooks = [];      // the other files' renderers, called with each state document
const eventHooks = {};      // event name -> the other files' reader of that event's data
let confirming = null;      // the model whose Delete button asks for a second click

const $ = (id) => document.getElementById(id);

// ---- formatting -------------------------------------------------------------------------------
function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;",
  })[c]);
}
function bytes(n) {
  if (n == null) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (v >= 100 || i === 0 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2)) + " " + units[i];
}
function duration(s) {
  if (s == null) return "—";
  s = Math.max(0, s);
  if (s < 60) return (s < 10 ? s.toFixed(1) : s.toFixed(0)) + " s";
  const m = Math.floor(s / 60);
  if (m < 60) return m + "m " + String(Math.floor(s % 60)).padStart(2, "0") + "s";
  const h = Math.floor(m / 60);
  return h + "h " + String(m % 60).padStart(2, "0") + "m";
}
function rate(x) {
  if (x == null) return "—";
  return x >= 100 ? x.toFixed(0) : x.toFixed(1);
}
function clock(t) {
  const d = new Date(t * 1000);
  return d.toLocaleTimeString([], { hour12: false });
}
const colours = new Map();  // model -> its colour, in the order models first held memory
function colour(name) {
  if (!colours.has(name)) colours.set(name, PALETTE[colours.size % PALETTE.length]);
  return colours.get(name);
}
function since() { return (performance.now() - receivedAt) / 1000; }

// ---- talking to corral ------------------------------------------------------------------------
function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (apiKey) h.Authorization = "Bearer " + apiKey;
  return h;
}
function needKey() {
  $("keybar").hidden = false;
  setConn("down", "API key needed");
}
async function call(method, path, body) {
  const res = await fetch(path, {
    method, headers: headers({ "Content-Type": "application/json" }),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
  if (res.status === 401) needKey();
  if (!res.ok || (data && data.error)) {
    const msg = data && data.error ? (data.error.message || data.error) : res.status + " " + res.statusText;
    throw new Error(String(msg));
  }
  return data;
}

function setConn(state, text) {
  const el = $("conn");
  el.dataset.state = state;
  $("conn-text").textContent = text;
}

async function poll() {
  try {
    const res = await fetch("/api/corral/state", { headers: headers(), cache: "no-store" });
    if (res.status === 401) { needKey(); return false; }
    if (!res.ok) throw new Error(res.status);
    update(await res.json());
    return true;
  } catch (e) {
    setConn("down", "corral is not answering");
    return false;
  }
}

async function stream() {
  const res = await fetch("/api/corral/events", { headers: headers(), cache: "no-store" });
  if (res.status === 401) { needKey(); throw new Error("unauthorized"); }
  if (!res.ok || !res.body) throw new Error("no stream");
  setConn("live", "live");
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (event === "state" && data.length) update(JSON.parse(data.join("\n")));
      else if (eventHooks[event] && data.length) eventHooks[event](JSON.parse(data.join("\n")));
    }
  }
}

async function run() {
  for (;;) {
    try {
      await stream();
    } catch (e) {
      // fall through: poll while the stream is down
    }
    if (!$("keybar").hidden) { await sleep(1000); continue; }
    setConn("polling", "reconnecting…");
    const ok = await poll();
    if (ok) setConn("polling", "polling");
    await sleep(2000);
  }
}
function sleep(ms) { return new Promise((r) => setTimeout(r, ms)); }

// ---- actions ----------------------------------------------------------------------------------
async function act(kind, model) {
  pending.set(model, kind);
  render();
  try {
    if (kind === "load") {
      await call("POST", "/api/generate", { model, stream: false });
      toast(`${model} is loaded`);
    } else {
      await call("POST", "/models/unload", { model });
      toast(`${model} is unloading`);
    }
  } catch (e) {
    toast(`${kind === "load" ? "Loading" : "Unloading"} ${model} failed: ${e.message}`, true);
  } finally {
    pending.delete(model);
    render();
  }
}

function toast(text, bad) {
  const el = document.createElement("div");
  el.className = "toast" + (bad ? " bad" : "");
  el.textContent = text;
  $("toasts").appendChild(el);
  setTimeout(() => el.remove(), bad ? 8000 : 3500);
}

// ---- rendering --------------------------------------------------------------------------------
function update(state) {
  last = state;
  receivedAt = performance.now();
  render();
}

function render() {
  if (!last) return;
  const s = last;
  $("version").textContent = "v" + s.version;
  renderSummary(s);
  renderDevices(s);
  renderWaiting(s);
  renderModels(s);
  renderEvents(s);
  for (const f of stateHooks) f(s);
}

function renderSummary(s) {
  const chips = [
    ["loaded", s.loaded],
    ["in flight", s.in_flight],
    ["queued", s.queued],
    ["models", s.models.length],
  ];
  $("summary").innerHTML = chips
    .map(([k, v]) => `<span class="chip"><b>${esc(v)}</b>${esc(k)}</span>`)
    .join("");
}

function renderDevices(s) {
  const html = s.devices.map((d) => {
    // The bar spans the device; under a budget far below it (CORRAL_MEMORY_LIMIT), the budget,
    // so that what corral books stays visible (what other programs use is then left out).
    const small = d.total && d.budget < d.total / 2;
    const scale = small
      ? Math.max(d.budget * 1.1, d.booked || 0, d.measured || 0, 1)
      : Math.max(d.total || 0, d.budget || 0, d.booked || 0, 1);
    const pct = (n) => Math.min(100, (100 * (n || 0)) / scale).toFixed(2) + "%";
    // One segment per runner (names of one file share one), under the name it is known by
    const owners = s.models.filter((m) => m.runner && m.runner.devices[d.id] && ownsRunner(m));
    const label = (m) => m.name + (m.runner.models && m.runner.models.length > 1 ? ` +${m.runner.models.length - 1}` : "");
    const segs = owners.map((m) => {
      const n = m.runner.devices[d.id];
      const cls = m.state === "loading" ? "seg loading" : "seg";
      return `<div class="${cls}" style="width:${pct(n)};background-color:${colour(m.name)}" title="${esc((m.runner.models || [m.name]).join(", "))}: ${esc(bytes(n))} booked"></div>`;
    }).join("");
    const who = owners.map((m) =>
      `<span class="who"><i style="background:${colour(m.name)}"></i>${esc(label(m))} ${esc(bytes(m.runner.devices[d.id]))}</span>`
    ).join("");
    return `
      <div class="device" data-device="${esc(d.id)}">
        <div class="device-head">
          <span class="id">${esc(d.id)}</span>
          <span class="dname">${esc(d.name !== d.id ? d.name : "")}</span>
          <span class="figures"><b>${esc(bytes(d.booked))}</b> booked · ${esc(bytes(d.measured))} measured · budget ${esc(bytes(d.budget))}${d.total ? ` · ${esc(bytes(d.in_use))} of ${esc(bytes(d.total))} in use` : ""}${d.others ? ` · ${esc(bytes(d.others))} held by other programs` : ""}${d.free != null ? ` · ${esc(bytes(d.free))} free` : ""}</span>
        </div>
        <div class="bar" title="in use on ${esc(d.id)} (all programs): ${esc(bytes(d.in_use))}">
          <div class="inuse" style="width:${small ? "0%" : pct(d.in_use)}"></div>
          <div class="segs">${segs}</div>
          <div class="measured" style="width:${pct(d.measured)}" title="measured: ${esc(bytes(d.measured))}"></div>
          <div class="budget" style="left:calc(${pct(d.budget)} - 1px)" title="budget: ${esc(bytes(d.budget))}"></div>
        </div>
        <div class="device-foot">${who || '<span class="faint">no model holds memory here</span>'}</div>
      </div>`;
  }).join("");
  const advice = (s.advice || []).map((a) => `<div class="advice">${esc(a)}</div>`).join("");
  $("devices").innerHTML = advice + html;
}

function stateCell(m) {
  const r = m.runner;
  let html = `<span class="pill st-${esc(m.state)}">${esc(STATE_LABEL[m.state] || m.state)}</span>`;
  if (m.state === "loading" && r) {
    const elapsed = r.loading_for == null ? null : r.loading_for + since();
    if (r.progress != null) {
      const p = Math.round(r.progress * 100);
      html += `<div class="progress" role="progressbar" aria-valuenow="${p}"><div style="width:${p}%"></div></div>`;
      // The weights are in memory; llama.cpp still warms the model up before it serves.
      const what = r.progress >= 0.99 ? "warming up" : `${p}%`;
      html += `<div class="under">${what} · ${esc(duration(elapsed))}</div>`;
    } else {
      html += `<div class="progress indeterminate"><div></div></div><div class="under">${esc(duration(elapsed))}</div>`;
    }
  } else if (r && r.load_seconds != null && (m.state === "ready" || m.state === "draining")) {
    html += `<div class="under">loaded in ${esc(duration(r.load_seconds))}</div>`;
    // What an eviction would cost: a reload reads from the page cache what is still there.
    if (r.page_cache != null) {
      const cached = Math.round(r.page_cache * 100);
      const reload = r.reload_seconds != null ? ` · reload ≈ ${esc(duration(r.reload_seconds))}` : "";
      html += `<div class="under page-cache" title="share of the model's file in the OS page cache, and the reload time the eviction policy predicts from it">${cached}% in page cache${reload}</div>`;
    }
  }
  return html;
}

// Whether a model's row stands for its runner: the runner is known by its name (models of one
// file and runner shape share one runner; the others' rows point to it).
function ownsRunner(m) {
  const names = (m.runner && m.runner.models) || [];
  return !names.length || names[0] === m.name || !names.includes(m.name);
}

function memoryCell(m) {
  const r = m.runner;
  if (!r) return `<span class="faint small">${m.file_bytes != null ? esc(bytes(m.file_bytes)) + " on disk" : "—"}</span>`;
  if (!ownsRunner(m)) return `<span class="shared" title="${esc(r.models.join(", "))}">in the runner of <b>${esc(r.models[0])}</b></span><div class="under">one process, booked once</div>`;
  const devs = Object.entries(r.devices)
    .map(([d, n]) => `<span class="dev"><b>${esc(bytes(n))}</b> ${esc(d)}</span>`)
    .join("");
  const measured = r.measured != null ? `<div class="under">measured ${esc(bytes(r.measured))}</div>` : "";
  // Names of one file and runner shape share one runner: its memory is counted once
  const others = (r.models || []).filter((n) => n !== m.name);
  const shared = others.length ? `<div class="under shared" title="${esc((r.models || []).join(", "))}">also serves ${esc(others.join(", "))}</div>` : "";
  return `<div class="mem">${devs || '<span class="faint">—</span>'}</div>${measured}${shared}`;
}

function keepAliveCell(m) {
  const r = m.runner;
  if (!r || m.state === "not_loaded") return '<span class="faint">—</span>';
  if (m.state === "loading") return '<span class="faint">after load</span>';
  if (m.state === "unloading") return '<span class="faint">stopping</span>';
  let text;
  if (r.keep_alive == null) text = "forever";
  else if (r.in_use > 0) text = "serving";
  else if (r.expires_in != null) text = duration(r.expires_in - since());
  else text = duration(r.keep_alive);
  const of = r.keep_alive == null ? "" : `<div class="under">of ${esc(duration(r.keep_alive))}${m.keep_alive_fixed ? " (fixed)" : ""}</div>`;
  // held for an agent's next turn: its last answer was a tool call
  const held = r.held_for ? `<div class="under">held for the agent's turn</div>` : "";
  return `<span>${esc(text)}</span>${of}${held}`;
}

function slotsCell(m) {
  const r = m.runner;
  if (!r || m.state === "not_loaded") return '<span class="faint">—</span>';
  const pips = Array.from({ length: Math.min(r.slots, 16) }, (_, i) => `<i class="${i < r.in_use ? "on" : ""}"></i>`).join("");
  return `<span class="slots">${pips}</span>${esc(r.in_use)} / ${esc(r.slots)}`;
}

// Speculative decoding: the share of drafted tokens the model accepted, and whether auto's
// drafting is off for it (why, on hover)
function draftsLine(m) {
  const tk = m.tokens || {}, d = m.drafting;
  const why = d ? ` title="${esc(d.why)}"` : "";
  const off = d && !d.on ? "drafting off" : "";
  const share = tk.drafted ? `drafts ${esc(Math.round((100 * tk.accepted) / tk.drafted))}% accepted` : "";
  const text = [share, off].filter(Boolean).join(" · ");
  return text ? `<div class="under drafts"${why}>${text}</div>` : "";
}

function tokensCell(m) {
  const t = m.tokens_per_second;
  if (!t) return `<span class="faint">—</span>${draftsLine(m)}`;
  if (!t.generated && !t.prompt) return `<span class="faint">idle</span>${draftsLine(m)}`;
  // Generated tokens/s as corral relays them; each busy slot's when several are
  const slots = ((m.runner && m.runner.slot_tokens_per_second) || []).filter((x) => x > 0);
  const per = slots.length > 1 ? `<div class="under">${slots.map((x) => esc(rate(x))).join(" + ")}</div>` : "";
  return `<span>${esc(rate(t.generated))}</span>${per}<div class="under">prompt ${esc(rate(t.prompt))}/s</div>${draftsLine(m)}`;
}

function actionCell(m) {
  const busy = pending.get(m.name);
  const word = { load: "Loading…", unload: "Unloading…", delete: "Deleting…" };
  if (busy) return `<button class="btn" disabled>${word[busy]}</button>`;
  const del = !m.registered || m.embedding_of ? "" : confirming === m.name
    ? `<button class="btn bad" data-act="delete" data-model="${esc(m.name)}">Delete ${esc(m.name)}?</button>`
    : `<button class="btn quiet" data-act="ask-delete" data-model="${esc(m.name)}" title="delete this model">Delete</button>`;
  let main = "";
  if (m.state === "not_loaded") {
    if (m.registered && !m.error) main = `<button class="btn primary" data-act="load" data-model="${esc(m.name)}">Load</button>`;
  } else if (m.state === "loading") {
    main = `<button class="btn" disabled>Loading…</button>`;
  } else if (m.state !== "unloading") {
    main = `<button class="btn danger" data-act="unload" data-model="${esc(m.name)}">Unload</button>`;
  }
  return `<div class="acts">${main}${del}</div>`;
}

function renderModels(s) {
  $("model-count").textContent = s.models.length ? `(${s.models.length})` : "";
  $("no-models").hidden = s.models.length > 0;
  // Models holding memory first (the ones to watch), then the rest; by name within each.
  const order = { loading: 0, ready: 0, draining: 0, unloading: 0, not_loaded: 1 };
  const models = [...s.models].sort((a, b) =>
    (order[a.state] ?? 1) - (order[b.state] ?? 1) || a.name.localeCompare(b.name));
  const rows = models.map((m) => {
    const d = m.details || {};
    const facts = [d.family, d.parameter_size, d.quantization_level].filter(Boolean).map(esc).join(" · ");
    const tags = [];
    if (m.pinned) tags.push('<span class="tag pin">pinned</span>');
    if (m.priority) tags.push(`<span class="tag">priority ${esc(m.priority)}</span>`);
    if (!m.registered) tags.push('<span class="tag err">file gone</span>');
    if (m.embedding_of) tags.push('<span class="tag" title="a second runner of this model, for embeddings">embedding runner</span>');
    if (m.error) tags.push(`<span class="tag err">unusable</span><span class="why-unusable">${esc(m.error)}</span>`);
    for (const c of m.capabilities || []) if (c !== "completion") tags.push(`<span class="tag">${esc(c)}</span>`);
    const loaded = m.state !== "not_loaded";
    const queue = m.queued ? `<span class="queue-hot">${esc(m.queued)}</span>` : '<span class="faint">0</span>';
    return `
      <tr class="${loaded ? "loaded" : ""}" data-model="${esc(m.name)}" data-state="${esc(m.state)}" style="--c:${loaded ? colour(m.name) : "transparent"}">
        <td><div class="mname"><a href="#" data-detail="${esc(m.embedding_of || m.name)}" title="details">${esc(m.name)}</a></div><div class="msub">${facts ? `<span>${facts}</span>` : ""}${tags.join("")}</div></td>
        <td class="state">${stateCell(m)}</td>
        <td class="memory">${memoryCell(m)}</td>
        <td class="num">${slotsCell(m)}</td>
        <td class="num">${queue}</td>
        <td>${keepAliveCell(m)}</td>
        <td class="num">${tokensCell(m)}</td>
        <td class="actions">${actionCell(m)}</td>
      </tr>`;
  }).join("");
  if (!pressed) $("model-rows").innerHTML = rows;  // else once released (see `pressed`)
}

// Who waits for a slot (or, granted one, for room in its runner's shared context), the queue's
// first; nothing shows when nobody waits.
function renderWaiting(s) {
  const list = s.waiting || [];
  $("waiting").hidden = list.length === 0;
  $("waiting-count").textContent = list.length ? `(${list.length})` : "";
  $("waiting-rows").innerHTML = list.map((w) => {
    const where = w.why === "room"
      ? "among those waiting for room on its runner"
      : `among the requests for ${w.model}; #${w.position} in the queue across models`;
    return `<tr data-request="${esc(w.request)}" data-why="${esc(w.why)}" data-waiting="${esc(w.model)}">
      <td>${esc(w.model)}</td>
      <td class="num place" title="${esc(where)}">${esc(w.place)} of ${esc(w.of)}</td>
      <td class="num">${esc(duration(w.waited + since()))}</td>
      <td class="why">${esc(w.reason)}</td>
    </tr>`;
  }).join("");
}

function eventText(e) {
  const m = `<b>${esc(e.model)}</b>`;
  switch (e.kind) {
    case "load": {
      const where = Object.entries(e.devices || {}).filter(([, n]) => n)
        .map(([d, n]) => `${esc(bytes(n))} on ${esc(d)}`).join(", ");
      return [`Loading ${m}`, where ? `booked ${where}` : ""];
    }
    case "ready": return [`${m} ready in ${esc(duration(e.seconds))}`, ""];
    case "load_failed": return [`${m} failed to load`, esc(e.message)];
    case "unload": {
      const why = REASON[e.reason] || e.reason || "unloaded";
      const room = e.room_for ? ` to make room for <b>${esc(e.room_for)}</b>` : "";
      // The scheduler's words where they add to the reason (not "evicted to make room ...").
      const says = e.reason === "options_change" || (e.reason === "memory" && !e.room_for);
      return [`${m}: ${esc(why)}${room}`, says ? esc(e.message) : ""];
    }
    case "crash": return [`${m} crashed`, null];
    case "stall": return [`${m} stopped answering for ${esc(duration(e.seconds))} and was killed`, ""];
    case "oom": return [`${m} ran out of memory`, `booked ×${esc(Number(e.factor).toFixed(2))} from now on`];
    case "refused": return [`Refused a request for ${m}`, esc(e.message)];
    default: return [`${esc(e.kind)} ${m}`, ""];
  }
}

function renderEvents(s) {
  const list = s.events || [];
  $("no-events").hidden = list.length > 0;
  const open = new Set([...document.querySelectorAll("#events details[open]")].map((el) => el.dataset.id));
  $("events").innerHTML = list.map((e) => {
    const [text, detail] = eventText(e);
    const id = `${e.at}-${e.kind}-${e.model}`;
    let extra = detail ? `<div class="detail">${detail}</div>` : "";
    if (e.kind === "crash") {
      extra = `<details data-id="${esc(id)}"${open.has(id) ? " open" : ""}><summary>last log lines</summary><pre>${esc(e.message)}</pre></details>`;
    }
    return `<li class="k-${esc(e.kind)}"><time>${esc(clock(e.at))}</time><div class="ev-body"><span class="kind">${esc(e.kind.replace("_", " "))}</span><span class="text">${text}</span>${extra}</div></li>`;
  }).join("");
}

// ---- wiring ----------------------------------------------------------------------------------
// A browser clicks only where a press and its release met one element: a state push that
// redrew the table in between lost the click on its button. So the table is not redrawn while
// pressed, and is redrawn once the release's click has run.
$("model-rows").addEventListener("pointerdown", () => { pressed = true; });
for (const type of ["pointerup", "pointercancel"]) {
  document.addEventListener(type, () => {
    if (!pressed) return;
    pressed = false;
    setTimeout(() => { if (last) renderModels(last); }, 0);
  });
}
document.addEventListener("click", (ev) => {
  const b = ev.target.closest("button[data-act]");
  if (b && (b.dataset.act === "load" || b.dataset.act === "unload")) act(b.dataset.act, b.dataset.model);
});
$("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  apiKey = $("key").value.trim();
  localStorage.setItem(KEY_STORE, apiKey);
  $("keybar").hidden = true;
  setConn("polling", "connecting…");
});
// Countdowns and load timers move between state pushes too.
setInterval(() => { if (last && since() > 0.9) render(); }, 1000);
run();
