// corral dashboard, the playground: chat with a model through corral's own /api/chat (streamed),
// with each answer's stats (tokens, time to first token, tokens/s, stop reason) and the request
// as curl.
"use strict";

let conversation = [];   // {role, content} of this chat so far
let talking = null;      // the AbortController of the answer streaming now

function chattable(m) {
  const caps = m.capabilities || [];
  return m.registered && !m.error && !m.embedding_of && (caps.length === 0 || caps.includes("completion"));
}

function renderPlaygroundModels(s) {
  const sel = $("pg-model");
  const names = s.models.filter(chattable).map((m) => m.name);
  const have = [...sel.options].map((o) => o.value);
  if (names.join("\n") === have.join("\n")) return;
  const keep = sel.value;
  sel.innerHTML = names.map((n) => `<option value="${esc(n)}">${esc(n)}</option>`).join("");
  if (names.includes(keep)) sel.value = keep;
  else if (names.includes("smollm2:135m")) sel.value = "smollm2:135m";  // the built-in one
  updateCurl();
}
stateHooks.push(renderPlaygroundModels);

function choosePlaygroundModel(name) {
  const sel = $("pg-model");
  if (![...sel.options].some((o) => o.value === name)) {
    sel.insertAdjacentHTML("beforeend", `<option value="${esc(name)}">${esc(name)}</option>`);
  }
  sel.value = name;
  updateCurl();
  $("playground").scrollIntoView({ behavior: "smooth" });
  $("pg-input").focus();
}

function numberOf(id) {
  const v = $(id).value.trim();
  return v === "" || !Number.isFinite(Number(v)) ? null : Number(v);
}

function chatRequest(messages) {
  const body = { model: $("pg-model").value, messages: [], stream: true };
  const system = $("pg-system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  body.messages.push(...messages);
  const options = {};
  const temp = numberOf("pg-temp");
  const ctx = numberOf("pg-ctx");
  const max = numberOf("pg-max");
  if (temp != null) options.temperature = temp;
  if (ctx != null) options.num_ctx = Math.round(ctx);
  if (max != null) options.num_predict = Math.round(max);
  if (Object.keys(options).length) body.options = options;
  return body;
}

function shellQuote(s) { return "'" + s.replace(/'/g, "'\\''") + "'"; }

function updateCurl() {
  const next = $("pg-input").value.trim();
  const messages = [...conversation];
  if (next) messages.push({ role: "user", content: next });
  const body = chatRequest(messages.length ? messages : [{ role: "user", content: "Hello!" }]);
  const lines = [`curl ${location.origin}/api/chat`];
  if (apiKey) lines.push(`  -H "Authorization: Bearer $CORRAL_API_KEY"`);
  lines.push(`  -d ${shellQuote(JSON.stringify(body, null, 2))}`);
  $("pg-curl").textContent = lines.join(" \\\n");
}

function bubble(role, text) {
  $("pg-empty").hidden = true;
  const div = document.createElement("div");
  div.className = "pg-msg " + role;
  div.innerHTML = `<div class="who">${esc(role)}</div><div class="content"></div>`;
  div.querySelector(".content").textContent = text;
  $("pg-log").appendChild(div);
  $("pg-log").scrollTop = $("pg-log").scrollHeight;
  return div;
}

function statsText(fin, ttft, wall) {
  const ns = 1e9;
  const out = [];
  const gen = fin.eval_count || 0;
  out.push(`<span title="prompt tokens evaluated, and generated tokens">${esc(fin.prompt_eval_count ?? 0)} in · <b>${esc(gen)}</b> out</span>`);
  if (ttft != null) out.push(`<span title="from sending the request to the first token, a load included">first token ${esc(duration(ttft))}</span>`);
  if (fin.eval_duration > 0) out.push(`<span><b>${esc(rate(gen / (fin.eval_duration / ns)))}</b> tokens/s</span>`);
  if (fin.prompt_eval_duration > 0 && fin.prompt_eval_count) {
    out.push(`<span>prompt ${esc(rate(fin.prompt_eval_count / (fin.prompt_eval_duration / ns)))} tokens/s</span>`);
  }
  if (fin.load_duration > 1e8) out.push(`<span>loaded in ${esc(duration(fin.load_duration / ns))}</span>`);
  out.push(`<span>${esc(duration(wall))} in all</span>`);
  out.push(`<span class="stop" title="why the answer ended">stop: <b>${esc(fin.done_reason || "?")}</b></span>`);
  return out.join("");
}

async function send(text) {
  const model = $("pg-model").value;
  if (!model || talking) return;
  const user = { role: "user", content: text };
  const body = chatRequest([...conversation, user]);
  conversation.push(user);
  bubble("user", text);
  const div = bubble("assistant", "");
  div.dataset.state = "streaming";
  const content = div.querySelector(".content");
  let thinking = null;
  let answer = "";
  talking = new AbortController();
  $("pg-send").disabled = true;
  $("pg-stop").hidden = false;
  const t0 = performance.now();
  let ttft = null;
  let final = null;
  try {
    const res = await fetch("/api/chat", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body), signal: talking.signal,
    });
    if (res.status === 401) needKey();
    if (!res.ok) throw new Error(await errorOf(res));
    for await (const chunk of ndjson(res)) {
      if (chunk.error) throw new Error(chunk.error);
      const msg = chunk.message || {};
      if ((msg.content || msg.thinking) && ttft == null) ttft = (performance.now() - t0) / 1000;
      if (msg.thinking) {
        if (!thinking) {
          thinking = document.createElement("div");
          thinking.className = "thinking";
          div.insertBefore(thinking, content);
        }
        thinking.textContent += msg.thinking;
      }
      if (msg.content) {
        answer += msg.content;
        content.textContent = answer;
        $("pg-log").scrollTop = $("pg-log").scrollHeight;
      }
      if (chunk.done) final = chunk;
    }
    conversation.push({ role: "assistant", content: answer });
    const stats = document.createElement("div");
    stats.className = "pg-stats";
    stats.innerHTML = statsText(final || {}, ttft, (performance.now() - t0) / 1000);
    div.appendChild(stats);
    div.dataset.state = "done";
  } catch (e) {
    const aborted = e.name === "AbortError";
    div.dataset.state = aborted ? "stopped" : "failed";
    const err = document.createElement("div");
    err.className = aborted ? "pg-stats" : "pg-error";
    err.textContent = aborted ? "stopped" : "Error: " + e.message;
    div.appendChild(err);
    if (answer) conversation.push({ role: "assistant", content: answer });
    else conversation.pop();  // nothing answered: the question may be asked again
  } finally {
    talking = null;
    $("pg-send").disabled = false;
    $("pg-stop").hidden = true;
    updateCurl();
  }
}

$("pg-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("pg-input").value.trim();
  if (!text || talking) return;
  $("pg-input").value = "";
  send(text);
});
$("pg-input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("pg-form").requestSubmit();
  }
});
$("pg-stop").addEventListener("click", () => { if (talking) talking.abort(); });
$("pg-clear").addEventListener("click", () => {
  if (talking) talking.abort();
  conversation = [];
  $("pg-log").querySelectorAll(".pg-msg").forEach((e) => e.remove());
  $("pg-empty").hidden = false;
  updateCurl();
});
for (const id of ["pg-model", "pg-temp", "pg-ctx", "pg-max", "pg-system", "pg-input"]) {
  $(id).addEventListener("input", updateCurl);
}
updateCurl();
