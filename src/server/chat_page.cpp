// Generated from src/server/static/ by src/server/static/embed.py; do not edit by hand.
#include "server/server.h"

namespace lily {

const char* const kChatPageHtml = R"lily_html(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>lily</title>
<style>
  :root { --bg: #f7f7f5; --panel: #fff; --ink: #1d1d1f; --muted: #6e6e73; --line: #e3e3e0; --accent: #7b5cd6;
          --user: #efeafc; --think: #f4f4f2; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--ink);
         background: var(--bg); display: flex; flex-direction: column; height: 100vh; }
  header { display: flex; align-items: center; gap: 12px; padding: 10px 20px; background: var(--panel);
           border-bottom: 1px solid var(--line); }
  header h1 { font-size: 17px; margin: 0; letter-spacing: .5px; }
  #status { font-size: 13px; color: var(--muted); }
  #status::before { content: "●"; margin-right: 5px; color: #c9c9c4; }
  #status.ok::before { color: #34c759; }
  #status.bad::before { color: #ff3b30; }
  header .spacer { flex: 1; }
  button, select, input, textarea { font: inherit; }
  .ghost { background: none; border: 1px solid var(--line); border-radius: 8px; padding: 4px 10px; cursor: pointer; }
  #settings { display: none; gap: 14px; flex-wrap: wrap; padding: 10px 20px; background: var(--panel);
              border-bottom: 1px solid var(--line); font-size: 13px; }
  #settings.open { display: flex; }
  #settings label { display: flex; flex-direction: column; gap: 3px; color: var(--muted); }
  #settings input[type=number] { width: 90px; }
  #settings textarea { width: 320px; height: 48px; }
  #log { flex: 1; overflow-y: auto; padding: 20px; display: flex; flex-direction: column; gap: 14px; }
  .msg { max-width: 820px; width: 100%; margin: 0 auto; }
  .msg .who { font-size: 12px; color: var(--muted); margin-bottom: 3px; }
  .msg .body { white-space: pre-wrap; word-wrap: break-word; background: var(--panel); border: 1px solid var(--line);
               border-radius: 12px; padding: 10px 14px; }
  .msg.user .body { background: var(--user); border-color: #ddd3f7; }
  .msg.error .body { background: #fff0ef; border-color: #ffc9c5; color: #a1160a; }
  details.think { margin-bottom: 6px; background: var(--think); border-radius: 10px; padding: 6px 12px;
                  font-size: 13px; color: var(--muted); }
  details.think summary { cursor: pointer; user-select: none; }
  details.think .text { white-space: pre-wrap; margin-top: 4px; }
  .tool { font: 12px/1.4 ui-monospace, monospace; background: #eef6ff; border-radius: 8px; padding: 6px 10px;
          margin-top: 6px; white-space: pre-wrap; }
  .stats { font-size: 12px; color: var(--muted); margin-top: 4px; }
  .cursor::after { content: "▍"; color: var(--accent); animation: blink 1s steps(2) infinite; }
  @keyframes blink { 50% { opacity: 0; } }
  form { display: flex; gap: 10px; padding: 14px 20px; background: var(--panel); border-top: 1px solid var(--line);
         justify-content: center; }
  #input { flex: 1; max-width: 740px; resize: none; height: 54px; border: 1px solid var(--line); border-radius: 12px;
           padding: 8px 12px; }
  #send { background: var(--accent); color: #fff; border: 0; border-radius: 12px; padding: 0 20px; cursor: pointer; }
  #send.stop { background: #444; }
  .empty { margin: auto; text-align: center; color: var(--muted); }
</style>
</head>
<body>
<header>
  <h1>lily</h1>
  <span id="status">connecting…</span>
  <span class="spacer"></span>
  <button class="ghost" id="clear" type="button">New chat</button>
  <button class="ghost" id="toggle-settings" type="button">Settings</button>
</header>
<div id="settings">
  <label>System prompt <textarea id="system" placeholder="(none)"></textarea></label>
  <label>Temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.7"></label>
  <label>Max tokens <input id="max-tokens" type="number" min="1" step="1" value="512"></label>
  <label>Thinking <select id="thinking"><option value="on">on</option><option value="off">off</option></select></label>
  <label>API key <input id="api-key" type="password" placeholder="if the server has one"></label>
</div>
<div id="log"><div class="empty" id="empty">Ask something. Answers stream from <code>/v1/chat/completions</code>.</div></div>
<form id="form">
  <textarea id="input" placeholder="Message lily (Enter to send, Shift+Enter for a new line)" autofocus></textarea>
  <button id="send" type="submit">Send</button>
</form>
<script src="chat.js"></script>
</body>
</html>
)lily_html";

const char* const kChatPageJs = R"lily_js(// lily's chat page: streams from /v1/chat/completions (SSE), shows reasoning in a collapsible block, keeps the
// conversation client-side and sends it whole each turn (the server's session cache makes that cheap).
"use strict";
const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], controller: null };

function settings() {
  return {
    system: $("system").value.trim(),
    temperature: parseFloat($("temperature").value),
    max_tokens: parseInt($("max-tokens").value, 10),
    thinking: $("thinking").value === "on",
    key: $("api-key").value.trim(),
  };
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = settings().key;
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = cls || "";
}

async function connect() {
  try {
    const health = await fetch("health");
    if (health.status === 503) {
      setStatus("loading the model…");
      setTimeout(connect, 1000);
      return;
    }
    const r = await fetch("v1/models", { headers: headers() });
    if (r.status === 401) {
      setStatus("API key needed (Settings)", "bad");
      $("settings").classList.add("open");
      return;
    }
    const models = await r.json();
    state.model = models.data[0].id;
    setStatus(state.model + " · " + models.data[0].max_model_len + " tokens of context", "ok");
  } catch (e) {
    setStatus("server unreachable", "bad");
    setTimeout(connect, 2000);
  }
}

function addMessage(role, text) {
  const empty = $("empty");
  if (empty) empty.remove();
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.innerHTML = '<div class="who"></div><div class="body"></div>';
  div.querySelector(".who").textContent = role === "user" ? "You" : role === "error" ? "Error" : state.model || "lily";
  div.querySelector(".body").textContent = text || "";
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function assistantView() {
  const div = addMessage("assistant", "");
  const body = div.querySelector(".body");
  const think = document.createElement("details");
  think.className = "think";
  think.open = true;
  think.innerHTML = '<summary>Reasoning</summary><div class="text"></div>';
  const answer = document.createElement("div");
  answer.className = "answer cursor";
  body.append(think, answer);
  think.style.display = "none";
  const stats = document.createElement("div");
  stats.className = "stats";
  div.appendChild(stats);
  return { div, think, thinkText: think.querySelector(".text"), answer, stats, body };
}

// Reads an SSE body and calls onEvent(json) for each `data:` event until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

async function send(text) {
  const s = settings();
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const view = assistantView();
  const messages = (s.system ? [{ role: "system", content: s.system }] : []).concat(state.history);
  const request = {
    model: state.model, messages, stream: true, stream_options: { include_usage: true },
    temperature: s.temperature, max_tokens: s.max_tokens,
    chat_template_kwargs: { enable_thinking: s.thinking },
  };
  state.controller = new AbortController();
  $("send").textContent = "Stop";
  $("send").classList.add("stop");
  const t0 = performance.now();
  let tFirst = null, reasoning = "", content = "", toolCalls = [], finish = null, usage = null;
  try {
    const r = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request), signal: state.controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({ error: { message: r.statusText } }));
      throw new Error(err.error.message);
    }
    await readEvents(r, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const d = choice.delta || {};
      if ((d.reasoning_content || d.content) && tFirst === null) tFirst = performance.now();
      if (d.reasoning_content) {
        reasoning += d.reasoning_content;
        view.think.style.display = "";
        view.thinkText.textContent = reasoning;
      }
      if (d.content) {
        if (!content && reasoning) view.think.open = false;  // the answer began: fold the reasoning
        content += d.content;
        view.answer.textContent = content;
      }
      for (const call of d.tool_calls || []) {
        toolCalls.push(call);
        const box = document.createElement("div");
        box.className = "tool";
        box.textContent = "tool call → " + call.function.name + "(" + call.function.arguments + ")";
        view.body.appendChild(box);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      $("log").scrollTop = $("log").scrollHeight;
    });
  } catch (e) {
    if (e.name !== "AbortError") {
      view.div.remove();
      addMessage("error", e.message);
      state.history.pop();
      return done();
    }
    finish = "stopped";
  }
  view.answer.classList.remove("cursor");
  const message = { role: "assistant", content };
  if (reasoning) message.reasoning_content = reasoning;
  if (toolCalls.length) message.tool_calls = toolCalls.map(({ id, type, function: f }) => ({ id, type, function: f }));
  state.history.push(message);
  const secs = (performance.now() - t0) / 1000;
  const parts = [finish || ""];
  if (usage) {
    parts.push(usage.completion_tokens + " tokens", (usage.completion_tokens / secs).toFixed(1) + " tok/s");
    parts.push("prompt " + usage.prompt_tokens + " (" + usage.prompt_tokens_details.cached_tokens + " cached)");
  }
  if (tFirst !== null) parts.push("first token " + Math.round(tFirst - t0) + " ms");
  view.stats.textContent = parts.filter(Boolean).join(" · ");
  done();
}

function done() {
  state.controller = null;
  $("send").textContent = "Send";
  $("send").classList.remove("stop");
  $("input").focus();
}

$("form").addEventListener("submit", (e) => {
  e.preventDefault();
  if (state.controller) return state.controller.abort();
  const text = $("input").value.trim();
  if (!text || !state.model) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("form").requestSubmit();
  }
});
$("toggle-settings").addEventListener("click", () => $("settings").classList.toggle("open"));
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.history = [];
  $("log").innerHTML = '<div class="empty" id="empty">New conversation.</div>';
});
$("api-key").addEventListener("change", connect);
connect();
)lily_js";

}  // namespace lily
