// corral dashboard, managing models: pull (with the progress `corral pull` shows: a bar per file,
// other statuses as lines), delete (a second click confirms), and a model's detail view.
"use strict";

// ---- reading an NDJSON stream (pull here, chat in the playground) ---------------------------
async function* ndjson(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (value) buf += decoder.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, i).trim();
      buf = buf.slice(i + 1);
      if (line) yield JSON.parse(line);
    }
    if (done) break;
  }
  if (buf.trim()) yield JSON.parse(buf);
}

async function errorOf(res) {
  const text = await res.text();
  try {
    const data = JSON.parse(text);
    return String((data.error && (data.error.message || data.error)) || res.status);
  } catch (e) {
    return text || res.status + " " + res.statusText;
  }
}

// ---- pull ---------------------------------------------------------------------------------------
let pulling = false;

async function pull(model) {
  pulling = true;
  $("pull-go").disabled = true;
  $("pull").hidden = false;
  $("pull").dataset.state = "pulling";
  $("pull-title").textContent = model;
  $("pull-status").textContent = "starting…";
  $("pull-files").innerHTML = "";
  $("pull-log").innerHTML = "";
  const files = new Map();  // digest -> {row, started, total}
  const log = (text) => {
    const li = document.createElement("li");
    li.textContent = text;
    $("pull-log").appendChild(li);
  };
  try {
    const res = await fetch("/api/pull", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ model, stream: true }),
    });
    if (res.status === 401) needKey();
    if (!res.ok) throw new Error(await errorOf(res));
    let ok = false;
    for await (const chunk of ndjson(res)) {
      if (chunk.error) throw new Error(chunk.error);
      const status = String(chunk.status || "");
      $("pull-status").textContent = status;
      if (chunk.digest && chunk.total) {
        let f = files.get(chunk.digest);
        if (!f) {
          const row = document.createElement("div");
          row.className = "pull-file";
          row.dataset.digest = chunk.digest;
          $("pull-files").appendChild(row);
          f = { row, started: performance.now(), total: chunk.total };
          files.set(chunk.digest, f);
        }
        const done = chunk.completed || 0;
        const pct = Math.min(100, (100 * done) / chunk.total);
        const secs = (performance.now() - f.started) / 1000;
        const speed = secs > 0.2 ? done / secs : 0;
        const left = speed > 0 ? (chunk.total - done) / speed : null;
        f.row.innerHTML = `<span class="what">${esc(status)}</span>
          <div class="progress"><div style="width:${pct.toFixed(1)}%"></div></div>
          <span class="num">${pct.toFixed(0)}%</span>
          <span class="num">${esc(bytes(done))} / ${esc(bytes(chunk.total))}</span>
          <span class="num">${speed ? esc(bytes(speed)) + "/s" : ""}</span>
          <span class="num">${left != null && done < chunk.total ? esc(duration(left)) : ""}</span>`;
        f.row.dataset.percent = pct.toFixed(0);
      } else if (status) {
        log(status);
        if (status === "success") ok = true;
      }
    }
    if (!ok) throw new Error("the pull ended without success");
    $("pull").dataset.state = "done";
    toast(`${model} is pulled`);
    poll();  // the new model shows at once
  } catch (e) {
    $("pull").dataset.state = "failed";
    $("pull-status").textContent = "failed: " + e.message;
    log("Error: " + e.message);
    toast(`Pulling ${model} failed: ${e.message}`, true);
  } finally {
    pulling = false;
    $("pull-go").disabled = false;
  }
}

$("pull-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const model = $("pull-name").value.trim();
  if (model && !pulling) pull(model);
});

// ---- delete -----------------------------------------------------------------------------------
async function remove(model) {
  confirming = null;
  pending.set(model, "delete");
  render();
  try {
    await call("DELETE", "/api/delete", { model });
    toast(`${model} is deleted`);
    await poll();
  } catch (e) {
    toast(`Deleting ${model} failed: ${e.message}`, true);
  } finally {
    pending.delete(model);
    render();
  }
}

document.addEventListener("click", (ev) => {
  const b = ev.target.closest("button[data-act]");
  if (b && b.dataset.act === "ask-delete") {
    confirming = b.dataset.model;
    render();
    // the question goes away if it is not answered
    setTimeout(() => { if (confirming === b.dataset.model) { confirming = null; render(); } }, 6000);
  } else if (b && b.dataset.act === "delete") {
    remove(b.dataset.model);
  }
  const a = ev.target.closest("[data-detail]");
  if (a) {
    ev.preventDefault();
    showDetail(a.dataset.detail);
  }
});

// ---- a model's detail view ----------------------------------------------------------------
let detailOf = null;

function section(title, html) {
  return `<section><h4>${esc(title)}</h4>${html}</section>`;
}

async function showDetail(name) {
  detailOf = name;
  $("detail-name").textContent = name;
  $("detail-body").innerHTML = '<p class="faint">Reading…</p>';
  if (!$("detail").open) $("detail").showModal();
  let show, extra;
  try {
    [show, extra] = await Promise.all([
      call("POST", "/api/show", { model: name }),
      call("GET", "/api/corral/model?name=" + encodeURIComponent(name)),
    ]);
  } catch (e) {
    $("detail-body").innerHTML = `<p class="bad">${esc(e.message)}</p>`;
    return;
  }
  if (detailOf !== name) return;
  const m = (last && last.models.find((x) => x.name === name)) || {};
  const d = show.details || {};
  const facts = [
    ["family", d.family], ["parameters", d.parameter_size], ["quantization", d.quantization_level],
    ["format", d.format], ["ID", extra.digest.slice(0, 12)], ["modified", show.modified_at],
  ].filter(([, v]) => v).map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("");
  const caps = (show.capabilities || []).map((c) => `<span class="tag">${esc(c)}</span>`).join(" ");
  const used = extra.runners.filter((r) => r.state !== "unloading");
  const trained = extra.context.trained;
  const ctx = used.length
    ? used.map((r) => {
      const pct = trained ? Math.min(100, (100 * r.context_length) / trained) : 0;
      return `<div class="ctx"><div class="progress"><div style="width:${pct.toFixed(1)}%"></div></div>
        <span><b>${esc(r.context_length)}</b> tokens in use (${esc(r.slots)} slot${r.slots > 1 ? "s" : ""}) of ${esc(trained || "?")} trained</span></div>`;
    }).join("")
    : `<p class="muted">Not loaded; trained on ${esc(trained || "?")} tokens${extra.context.default ? `, num_ctx ${esc(extra.context.default)} set` : ""}.</p>`;
  const files = `<table class="files"><thead><tr><th>role</th><th>file</th><th class="num">size</th><th>digest</th></tr></thead><tbody>${
    extra.files.map((f) => `<tr><td>${esc(f.role)}</td><td class="mono">${esc(f.file)}</td><td class="num">${esc(bytes(f.size))}</td><td class="mono" title="${esc(f.digest || "")}">${esc(f.digest ? f.digest.slice(0, 19) + "…" : "—")}</td></tr>`).join("")
  }</tbody></table>`;
  const journal = extra.journal.length
    ? `<ol class="events mini">${extra.journal.slice().reverse().map((e) => {
      const [text, detail] = eventText(e);
      return `<li class="k-${esc(e.kind)}"><time>${esc(clock(e.at))}</time><div class="ev-body"><span class="kind">${esc(e.kind.replace("_", " "))}</span><span class="text">${text}</span>${detail ? `<div class="detail">${detail}</div>` : ""}</div></li>`;
    }).join("")}</ol>`
    : '<p class="faint">Not loaded since corral started.</p>';
  $("detail-body").innerHTML = [
    section("Model", `<dl class="facts">${facts}</dl><div>${caps}</div>${m.error ? `<p class="bad">unusable: ${esc(m.error)}</p>` : ""}`),
    section("Context", ctx),
    section("Files", files),
    section("Loads", journal),
    section("Parameters", show.parameters ? `<pre>${esc(show.parameters)}</pre>` : '<p class="faint">none set</p>'),
    show.system ? section("System prompt", `<pre>${esc(show.system)}</pre>`) : "",
    section("Template", show.template ? `<pre>${esc(show.template)}</pre>` : '<p class="faint">none</p>'),
  ].join("");
}

$("detail-close").addEventListener("click", () => $("detail").close());
$("detail").addEventListener("close", () => { detailOf = null; });
$("detail-chat").addEventListener("click", () => {
  const name = detailOf;
  $("detail").close();
  if (name) choosePlaygroundModel(name);
});
