// lily's chat page: streams from /v1/chat/completions (SSE) and renders the answer as markdown with highlighted
// code (render.js), reasoning in a collapsible block; keeps the conversations in this browser (store.js) and
// sends the current one whole each turn (the server's session cache makes that cheap).
"use strict";
import { copyButtonClicked, renderMarkdown } from "./render.js";
import { Store, newConversation, titleOf } from "./store.js";

const $ = (id) => document.getElementById(id);
const store = new Store();
const state = { model: null, conversation: null, controller: null };
const SETTING_FIELDS = ["system", "temperature", "max-tokens", "thinking"];

function settings() {
  return {
    system: $("system").value.trim(),
    temperature: parseFloat($("temperature").value),
    max_tokens: parseInt($("max-tokens").value, 10),
    thinking: $("thinking").value === "on",
    key: $("api-key").value.trim(),
  };
}

function restoreSettings() {
  const saved = store.settings();
  for (const id of SETTING_FIELDS) if (typeof saved[id] === "string") $(id).value = saved[id];
  $("api-key").value = sessionStorage.getItem("lily.api_key") || "";
}

function saveSettings() {
  store.saveSettings(Object.fromEntries(SETTING_FIELDS.map((id) => [id, $(id).value])));
  sessionStorage.setItem("lily.api_key", $("api-key").value);
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

// ---- the log ----

const nearBottom = () => { const l = $("log"); return l.scrollHeight - l.scrollTop - l.clientHeight < 80; };
const toBottom = () => { $("log").scrollTop = $("log").scrollHeight; };

function showEmpty(text) {
  const div = document.createElement("div");
  div.className = "empty";
  div.id = "empty";
  div.textContent = text;
  $("log").replaceChildren(div);
}

function addMessage(role, text, model) {
  const empty = $("empty");
  if (empty) empty.remove();
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : role === "error" ? "Error" : model || state.model || "lily";
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text || "";
  div.append(who, body);
  $("log").appendChild(div);
  return div;
}

// An assistant message's view; update(message, streaming) redraws it from the message.
function assistantView(model) {
  const div = addMessage("assistant", "", model);
  const body = div.querySelector(".body");
  const think = document.createElement("details");
  think.className = "think";
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const thinkText = document.createElement("div");
  thinkText.className = "text";
  think.append(summary, thinkText);
  think.hidden = true;
  const answer = document.createElement("div");
  answer.className = "answer";
  const tools = document.createElement("div");
  const stats = document.createElement("div");
  stats.className = "stats";
  body.append(think, answer, tools);
  div.appendChild(stats);
  let shownContent = null, shownCalls = 0;
  return {
    div,
    update(message, streaming) {
      const stick = nearBottom();
      const reasoning = message.reasoning_content || "";
      think.hidden = !reasoning;
      thinkText.textContent = reasoning;
      summary.textContent = streaming && !message.content ? "Reasoning…" : "Reasoning";
      if (message.content !== shownContent) {
        answer.replaceChildren(renderMarkdown(message.content));
        shownContent = message.content;
      }
      answer.classList.toggle("cursor", !!streaming);
      const calls = Array.isArray(message.tool_calls) ? message.tool_calls : [];
      for (; shownCalls < calls.length; ++shownCalls) {
        const box = document.createElement("div");
        box.className = "tool";
        const f = (calls[shownCalls] && calls[shownCalls].function) || {};
        box.textContent = "tool call → " + f.name + "(" + f.arguments + ")";
        tools.appendChild(box);
      }
      stats.textContent = message.stats || "";
      if (stick) toBottom();
    },
    fold(open) { think.open = open; },
  };
}

function showConversation(conversation) {
  state.conversation = conversation;
  store.setCurrentId(conversation.id);
  if (!conversation.messages.length) showEmpty("Ask something. Answers stream from /v1/chat/completions.");
  else $("log").replaceChildren();
  for (const m of conversation.messages) {
    if (m.role === "user") addMessage("user", m.content);
    else assistantView(m.model).update(m, false);
  }
  toBottom();
  showConversationList();
}

// ---- the conversation list ----

function when(ms) {
  const d = new Date(ms), now = new Date();
  return d.toDateString() === now.toDateString()
    ? d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }) : d.toLocaleDateString();
}

function showConversationList() {
  const items = store.list().map((c) => {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    if (state.conversation && c.id === state.conversation.id) li.className = "active";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = titleOf(c);
    const time = document.createElement("span");
    time.className = "when";
    time.textContent = when(c.updated);
    open.append(title, time);
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.title = "Delete this conversation";
    del.textContent = "×";
    li.append(open, del);
    return li;
  });
  $("conversations").replaceChildren(...items);
}

function persist(conversation) {
  const dropped = store.save(conversation);
  if (dropped) console.warn("lily: browser storage full, dropped the " + dropped + " oldest conversation(s)");
  showConversationList();
}

// ---- sending ----

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

// The conversation as the API takes it: display-only fields left out.
function apiMessages(system) {
  const turns = state.conversation.messages.map((m) => {
    const out = { role: m.role, content: m.content };
    if (m.reasoning_content) out.reasoning_content = m.reasoning_content;
    if (m.tool_calls) out.tool_calls = m.tool_calls;
    return out;
  });
  return (system ? [{ role: "system", content: system }] : []).concat(turns);
}

function statsLine(finish, usage, secs, firstMs) {
  const parts = [finish || ""];
  if (usage) {
    parts.push(usage.completion_tokens + " tokens", (usage.completion_tokens / secs).toFixed(1) + " tok/s");
    parts.push("prompt " + usage.prompt_tokens + " (" + usage.prompt_tokens_details.cached_tokens + " cached)");
  }
  if (firstMs !== null) parts.push("first token " + Math.round(firstMs) + " ms");
  return parts.filter(Boolean).join(" · ");
}

async function send(text) {
  saveSettings();
  const s = settings();
  const conversation = state.conversation;
  conversation.messages.push({ role: "user", content: text });
  persist(conversation);
  addMessage("user", text);
  const view = assistantView(state.model);
  toBottom();
  const request = {
    model: state.model, messages: apiMessages(s.system), stream: true, stream_options: { include_usage: true },
    temperature: s.temperature, max_tokens: s.max_tokens, chat_template_kwargs: { enable_thinking: s.thinking },
  };
  state.controller = new AbortController();
  $("send").textContent = "Stop";
  $("send").classList.add("stop");
  const t0 = performance.now();
  const message = { role: "assistant", content: "", model: state.model };
  let tFirst = null, finish = null, usage = null, frame = 0;
  const redraw = () => { frame = 0; view.update(message, true); };
  view.fold(true);
  try {
    const r = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request), signal: state.controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({ error: { message: r.status + " " + r.statusText } }));
      throw new Error(err.error.message);
    }
    await readEvents(r, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const d = choice.delta || {};
      if ((d.reasoning_content || d.content) && tFirst === null) tFirst = performance.now();
      if (d.reasoning_content) message.reasoning_content = (message.reasoning_content || "") + d.reasoning_content;
      if (d.content) {
        if (!message.content && message.reasoning_content) view.fold(false);  // the answer began: fold the reasoning
        message.content += d.content;
      }
      if (d.tool_calls) {
        message.tool_calls = (message.tool_calls || []).concat(
          d.tool_calls.map(({ id, type, function: f }) => ({ id, type, function: f })));
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      if (!frame) frame = requestAnimationFrame(redraw);  // at most one markdown render per frame
    });
  } catch (e) {
    if (e.name !== "AbortError") {
      if (frame) cancelAnimationFrame(frame);
      view.div.remove();
      addMessage("error", e.message);
      conversation.messages.pop();  // the question did not get an answer: back to the input box
      persist(conversation);
      if (!$("input").value) $("input").value = text;
      return done();
    }
    finish = "stopped";
  }
  if (frame) cancelAnimationFrame(frame);
  message.stats = statsLine(finish, usage, (performance.now() - t0) / 1000, tFirst === null ? null : tFirst - t0);
  conversation.messages.push(message);
  if (state.conversation === conversation) view.update(message, false);
  persist(conversation);
  done();
}

function done() {
  state.controller = null;
  $("send").textContent = "Send";
  $("send").classList.remove("stop");
  $("input").focus();
}

function stopAnswer() {
  if (state.controller) state.controller.abort();
}

// ---- wiring ----

$("form").addEventListener("submit", (e) => {
  e.preventDefault();
  if (state.controller) return stopAnswer();
  const text = $("input").value.trim();
  if (!text || !state.model) return;
  $("input").value = "";
  $("input").style.height = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("form").requestSubmit();
  } else if (e.key === "Escape") {
    stopAnswer();
  }
});
$("input").addEventListener("input", () => {
  const input = $("input");
  input.style.height = "";
  input.style.height = Math.min(input.scrollHeight + 2, 240) + "px";
});
$("toggle-settings").addEventListener("click", () => $("settings").classList.toggle("open"));
$("toggle-sidebar").addEventListener("click", () => $("sidebar").classList.toggle("hidden"));
$("new-chat").addEventListener("click", () => {
  stopAnswer();
  if (state.conversation.messages.length) showConversation(newConversation());
  $("input").focus();
});
$("conversations").addEventListener("click", (e) => {
  const li = e.target.closest("li");
  if (!li) return;
  if (e.target.closest(".delete")) {
    store.remove(li.dataset.id);
    if (state.conversation.id === li.dataset.id) {
      stopAnswer();
      showConversation(newConversation());
    }
    return showConversationList();
  }
  if (li.dataset.id === state.conversation.id) return;
  const c = store.get(li.dataset.id);
  if (c) {
    stopAnswer();
    showConversation(c);
    if (narrow.matches) $("sidebar").classList.add("hidden");  // the list covers the chat there
  }
});
$("log").addEventListener("click", copyButtonClicked);
for (const id of SETTING_FIELDS.concat(["api-key"])) $(id).addEventListener("change", saveSettings);
$("api-key").addEventListener("change", connect);
window.addEventListener("storage", (e) => { if (e.key === null || e.key.startsWith("lily.")) showConversationList(); });

const narrow = window.matchMedia("(max-width: 760px)");
if (narrow.matches) $("sidebar").classList.add("hidden");
restoreSettings();
showConversation(store.get(store.currentId()) || newConversation());
connect();
