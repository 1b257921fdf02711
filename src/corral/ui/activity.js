// corral dashboard, what happened: the last requests (the activity ring, as they end) and the
// server's log lines, both pushed on the events stream (`event: activity`, `event: log`): the
// page polls nothing, so looking at it adds no line to either.
"use strict";

const ACT_KEEP = 500;    // requests the page holds (the server's ring holds as many)
const ACT_SHOWN = 200;   // rows the table shows, newest first, of those that match the filters
const LOG_KEEP = 1000;   // log lines the page holds
const LEVELS = { debug: 10, info: 20, warning: 30, error: 40, critical: 50 };

let requests = [];       // newest first
let knownModels = "";    // the state's model names, so a row links only a model that is there
let logLines = [];       // oldest first

// ---- requests ---------------------------------------------------------------------------------
function statusMatches(filter, status) {
  if (!filter) return true;
  if (filter === "ok") return status < 400;
  if (filter === "error") return status >= 400;
  return Math.floor(status / 100) === Number(filter[0]);  // "4xx"
}

function tokensText(r) {
  if (r.prompt_tokens == null && r.generated_tokens == null) return '<span class="faint">—</span>';
  return `${esc(r.prompt_tokens ?? "—")} / ${esc(r.generated_tokens ?? "—")}`;
}

function seconds(x) {
  if (x == null) return '<span class="faint">—</span>';
  return esc(x < 1 ? (x * 1000).toFixed(0) + " ms" : x.toFixed(2) + " s");
}

function requestRow(r, names) {
  const model = !r.model ? '<span class="faint">—</span>'
    : names.has(r.model) ? `<a href="#" data-open="${esc(r.model)}" title="details">${esc(r.model)}</a>`
    : esc(r.model);
  const cls = r.status >= 500 ? "s5" : r.status >= 400 ? "s4" : "s2";
  const err = r.error ? `<div class="act-error">${esc(r.error)}</div>` : "";
  const t = new Date(r.time);
  return `<tr data-id="${esc(r.id)}" data-status="${esc(r.status)}" data-request-model="${esc(r.model || "")}">
    <td class="mono" title="${esc(r.time)}">${esc(t.toLocaleTimeString([], { hour12: false }))}</td>
    <td class="mono">${esc(r.client || "—")}</td>
    <td><span class="mono">${esc(r.method)} ${esc(r.route)}</span>${err}</td>
    <td class="act-model">${model}</td>
    <td class="num"><span class="code ${cls}">${esc(r.status)}</span></td>
    <td class="num">${tokensText(r)}</td>
    <td class="num">${seconds(r.time_to_first_token)}</td>
    <td class="num">${r.tokens_per_second == null ? '<span class="faint">—</span>' : esc(rate(r.tokens_per_second))}</td>
    <td class="num">${seconds(r.duration)}</td>
  </tr>`;
}

function renderActivity() {
  const model = $("act-model").value;
  const status = $("act-status").value;
  const names = new Set(knownModels.split("\n"));
  const shown = requests.filter((r) => (!model || r.model === model) && statusMatches(status, r.status));
  $("act-rows").innerHTML = shown.slice(0, ACT_SHOWN).map((r) => requestRow(r, names)).join("");
  $("act-count").textContent = requests.length ? `(${shown.length} of ${requests.length})` : "";
  $("no-activity").hidden = shown.length > 0;
  $("no-activity").textContent = requests.length ? "No request matches." : "No requests yet.";
  // the model filter offers every model seen in a request
  const sel = $("act-model");
  const models = [...new Set(requests.map((r) => r.model).filter(Boolean))].sort();
  if (model && !models.includes(model)) models.unshift(model);
  const have = [...sel.options].slice(1).map((o) => o.value);
  if (have.join("\n") !== models.join("\n")) {
    sel.innerHTML = '<option value="">all</option>' +
      models.map((m) => `<option value="${esc(m)}">${esc(m)}</option>`).join("");
    sel.value = model;
  }
}

eventHooks.activity = (doc) => {
  if (doc.full) requests = doc.requests;
  else {
    const seen = new Set(requests.map((r) => r.id));
    requests = doc.requests.filter((r) => !seen.has(r.id)).concat(requests);
  }
  if (requests.length > ACT_KEEP) requests.length = ACT_KEEP;
  renderActivity();
};

stateHooks.push((s) => {
  const names = s.models.map((m) => m.name).join("\n");
  if (names !== knownModels) {
    knownModels = names;
    renderActivity();
  }
});

// ---- the server's log -------------------------------------------------------------------------
function logItem(x) {
  const li = document.createElement("li");
  li.className = "lv-" + x.level;
  li.dataset.level = x.level;
  const t = new Date(x.time * 1000);
  const ms = String(t.getMilliseconds()).padStart(3, "0");
  li.innerHTML = `<time>${esc(t.toLocaleTimeString([], { hour12: false }))}.${ms}</time><span class="lv">${esc(x.level)}</span><span class="lg">${esc(x.logger)}</span><span class="msg">${esc(x.message)}</span>`;
  return li;
}

function logShown(x) {
  return (LEVELS[x.level] ?? 0) >= (LEVELS[$("log-level").value] ?? 0);
}

function appendLog(lines, full) {
  const box = $("log-lines");
  const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 30;
  if (full) box.textContent = "";
  const frag = document.createDocumentFragment();
  for (const x of lines) if (logShown(x)) frag.appendChild(logItem(x));
  box.appendChild(frag);
  while (box.childElementCount > LOG_KEEP) box.firstElementChild.remove();
  $("no-log").hidden = box.childElementCount > 0;
  if (atEnd || full) box.scrollTop = box.scrollHeight;  // follow the end unless scrolled up
}

// Lines are numbered by the server: a gap means the page fell behind and the server dropped
// what did not fit its queue for this page; say so where they would have been.
function withGaps(lines, after) {
  const out = [];
  let last = after;
  for (const x of lines) {
    if (last != null && x.id > last + 1) {
      const n = x.id - last - 1;
      out.push({ id: x.id - 0.5, time: x.time, level: "warning", logger: "dashboard",
                 message: `${n} log line${n === 1 ? "" : "s"} not shown: the page fell behind (all are in the server's own log)` });
    }
    out.push(x);
    last = x.id;
  }
  return out;
}

eventHooks.log = (doc) => {
  if (!doc.full) doc.lines = withGaps(doc.lines, logLines.length ? logLines[logLines.length - 1].id : null);
  if (doc.full) logLines = doc.lines;
  else logLines = logLines.concat(doc.lines);
  if (logLines.length > LOG_KEEP) logLines = logLines.slice(-LOG_KEEP);
  appendLog(doc.full ? logLines : doc.lines, doc.full);
};

// a row's model opens its detail view (models.js)
$("act-rows").addEventListener("click", (ev) => {
  const a = ev.target.closest("a[data-open]");
  if (a) {
    ev.preventDefault();
    showDetail(a.dataset.open);
  }
});
$("act-model").addEventListener("change", renderActivity);
$("act-status").addEventListener("change", renderActivity);
$("log-level").addEventListener("change", () => appendLog(logLines, true));
