// corral dashboard, the last hour: reads /api/corral/history (samples of the scheduler's view
// every few seconds, and the journal's marks) and draws small SVG charts, no library.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const CHART_H = 120;
const PAD = { l: 58, r: 10, t: 8, b: 18 };
const MARK_COLOUR = {
  load: "var(--loading)", ready: "var(--ready)", unload: "var(--unloading)",
  crash: "var(--bad)", load_failed: "var(--bad)", stall: "var(--bad)", oom: "var(--bad)",
};
let hist = null;  // the history document: in full from the event stream, then what is new
let histAt = 0;   // when it last came (performance.now())

// The state stream brings the history; only while it is down is the history fetched.
async function pollHistory() {
  for (;;) {
    await sleep(5000);
    if ($("conn").dataset.state === "live" && performance.now() - histAt < 60000) continue;
    try {
      const res = await fetch("/api/corral/history", { headers: headers(), cache: "no-store" });
      if (res.ok) applyHistory(Object.assign(await res.json(), { full: true }));
    } catch (e) {
      // the state stream says when corral is down; try again later
    }
  }
}

// A delta: its samples and marks go after those the page has, and what left the window goes.
function applyHistory(doc) {
  histAt = performance.now();
  if (doc.full || !hist) {
    hist = doc;
  } else {
    const n0 = hist.time.length;
    const n1 = doc.time.length;
    const pad = (old, add, fill) => (old || Array(n0).fill(fill)).concat(add || Array(n1).fill(fill));
    for (const id of new Set([...Object.keys(hist.devices), ...Object.keys(doc.devices)])) {
      const a = hist.devices[id] || {};
      const b = doc.devices[id] || {};
      const d = Object.assign({}, a, b);
      for (const k of ["booked", "measured", "in_use"]) d[k] = pad(a[k], b[k], null);
      hist.devices[id] = d;
    }
    const rates = hist.tokens_per_second;
    for (const m of new Set([...Object.keys(rates), ...Object.keys(doc.tokens_per_second)])) {
      rates[m] = pad(rates[m], doc.tokens_per_second[m], 0);
    }
    hist.in_flight = hist.in_flight.concat(doc.in_flight);
    hist.queued = hist.queued.concat(doc.queued);
    hist.time = hist.time.concat(doc.time);
    hist.marks = hist.marks.concat(doc.marks);
    Object.assign(hist, { now: doc.now, interval: doc.interval, window: doc.window });
    const start = hist.now - hist.window;
    let k = 0;
    while (k < hist.time.length && hist.time[k] < start) k++;
    if (k) {
      const cut = (xs) => xs.slice(k);
      hist.time = cut(hist.time);
      hist.in_flight = cut(hist.in_flight);
      hist.queued = cut(hist.queued);
      for (const d of Object.values(hist.devices)) for (const s of ["booked", "measured", "in_use"]) d[s] = cut(d[s]);
      for (const m of Object.keys(rates)) {
        rates[m] = cut(rates[m]);
        if (!rates[m].some((x) => x > 0)) delete rates[m];
      }
    }
    hist.marks = hist.marks.filter((m) => m.at >= start);
  }
  drawCharts();
}
eventHooks.history = applyHistory;

function el(name, attrs, text) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text != null) e.textContent = text;
  return e;
}

function count(x) { return x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : String(+x.toFixed(2)); }

// One chart: series [{name, values, colour, dash?, fill?}] over the shared time axis.
function chart(title, key, series, fmt, marks, extra) {
  const h = hist;
  const box = document.createElement("div");
  box.className = "chart";
  box.dataset.chart = key;
  const width = Math.max(320, ($("charts").clientWidth || 900) / ($("charts").clientWidth > 900 ? 2 : 1) - 12);
  const t1 = h.now;
  const t0 = h.time.length ? Math.max(t1 - h.window, Math.min(h.time[0], t1 - 60)) : t1 - 60;
  const W = width - PAD.l - PAD.r;
  const H = CHART_H - PAD.t - PAD.b;
  let top = 0;
  for (const s of series) for (const v of s.values) if (v != null && v > top) top = v;
  // A budget far above what is used would flatten every line: then it is only named.
  const level = extra != null && extra <= Math.max(top, 1) * 1.5 ? extra : null;
  if (level != null && level > top) top = level;
  top = top > 0 ? top * 1.08 : 1;
  const x = (t) => PAD.l + ((t - t0) / (t1 - t0)) * W;
  const y = (v) => PAD.t + H - (v / top) * H;
  const svg = el("svg", { viewBox: `0 0 ${width} ${CHART_H}`, width, height: CHART_H, role: "img", "aria-label": title });
  // grid: the top, the middle and the zero line, with their values
  for (const f of [1, 0.5, 0]) {
    const yy = PAD.t + H - f * H;
    svg.appendChild(el("line", { x1: PAD.l, x2: PAD.l + W, y1: yy, y2: yy, class: "grid" }));
    svg.appendChild(el("text", { x: PAD.l - 6, y: yy + 4, class: "tick", "text-anchor": "end" }, fmt((top / 1.08) * f)));
  }
  const span = t1 - t0;
  svg.appendChild(el("text", { x: PAD.l, y: CHART_H - 4, class: "tick" }, span >= 90 ? `−${Math.round(span / 60)} min` : `−${Math.round(span)} s`));
  svg.appendChild(el("text", { x: PAD.l + W, y: CHART_H - 4, class: "tick", "text-anchor": "end" }, "now"));
  if (level != null) {  // a budget: a dashed level
    svg.appendChild(el("line", { x1: PAD.l, x2: PAD.l + W, y1: y(level), y2: y(level), class: "budget-line" }));
  }
  for (const m of marks) {
    if (m.at < t0) continue;
    const g = el("g", { class: "mark", "data-kind": m.kind });
    g.appendChild(el("line", { x1: x(m.at), x2: x(m.at), y1: PAD.t, y2: PAD.t + H, stroke: MARK_COLOUR[m.kind] || "var(--muted)" }));
    g.appendChild(el("title", {}, `${clock(m.at)} ${m.kind} ${m.model}${m.reason ? " (" + m.reason + ")" : ""}${m.room_for ? " for " + m.room_for : ""}`));
    svg.appendChild(g);
  }
  for (const s of series) {
    const pts = [];
    s.values.forEach((v, i) => { if (v != null) pts.push(`${x(h.time[i]).toFixed(1)},${y(v).toFixed(1)}`); });
    if (s.fill && pts.length > 1) {
      const first = pts[0].split(",")[0];
      const lastX = pts[pts.length - 1].split(",")[0];
      svg.appendChild(el("polygon", { points: `${first},${PAD.t + H} ${pts.join(" ")} ${lastX},${PAD.t + H}`, fill: s.colour, class: "area" }));
    }
    const line = el("polyline", { points: pts.join(" "), stroke: s.colour, class: "series" + (s.dash ? " dash" : ""), "data-series": s.name, "data-points": pts.length });
    line.appendChild(el("title", {}, s.name));
    svg.appendChild(line);
  }
  const lastOf = (s) => { for (let i = s.values.length - 1; i >= 0; i--) if (s.values[i] != null) return s.values[i]; return null; };
  const legend = series.map((s) => `<span><i style="background:${s.colour}"></i>${esc(s.name)} <b>${esc(lastOf(s) == null ? "—" : fmt(lastOf(s)))}</b></span>`).join("");
  const budget = extra != null ? `<span><i class="budget"></i>budget <b>${esc(fmt(extra))}</b></span>` : "";
  box.innerHTML = `<div class="chart-head"><span class="chart-title">${esc(title)}</span><span class="chart-legend">${legend}${budget}</span></div>`;
  box.appendChild(svg);
  return box;
}

function drawCharts() {
  const h = hist;
  if (!h) return;
  $("no-history").hidden = h.time.length > 1;
  const marks = h.marks || [];
  const boxes = [];
  for (const [id, d] of Object.entries(h.devices)) {
    const name = d.name && d.name !== id ? `${id} · ${d.name}` : id;
    // Under a budget far below the device (CORRAL_MEMORY_LIMIT), what all programs use would
    // flatten corral's lines: it is left out, as the device's bar leaves it out.
    const small = d.total && d.budget && d.budget < d.total / 2;
    const series = [
      { name: "booked", values: d.booked, colour: "var(--accent)" },
      { name: "measured", values: d.measured, colour: "var(--measured)", dash: true },
    ];
    if (!small) series.unshift({ name: "in use (all programs)", values: d.in_use, colour: "var(--inuse)", fill: true });
    boxes.push(chart(`Memory on ${name}`, "memory-" + id, series, bytes, marks, d.budget));
  }
  const models = Object.keys(h.tokens_per_second).sort();
  boxes.push(chart("Generated tokens/s", "tokens", models.length
    ? models.map((m) => ({ name: m, values: h.tokens_per_second[m], colour: colour(m) }))
    : [{ name: "all models", values: h.time.map(() => 0), colour: "var(--faint)" }], count, marks));
  boxes.push(chart("Requests", "requests", [
    { name: "in flight", values: h.in_flight, colour: "var(--ready)" },
    { name: "queued", values: h.queued, colour: "var(--draining)" },
  ], count, marks));
  $("charts").replaceChildren(...boxes);
}

window.addEventListener("resize", () => drawCharts());
pollHistory();
