// lily's chat page: streams from /v1/chat/completions (SSE), shows reasoning in a collapsible block, keeps the
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
