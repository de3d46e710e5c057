// Conversations kept in this browser (localStorage), so a reload, a closed tab or a restarted server loses
// nothing. One key holds the list, most recently used first:
//   lily.conversations.v1 = [{id, title, updated, messages: [{role, content, reasoning_content?, tool_calls?,
//                                                              model?, stats?}]}]
// Messages are OpenAI chat messages plus, for display only, the model that answered and the usage line. When the storage is full the
// oldest conversations are dropped, never the one being written. Settings live under lily.settings; the API
// key only in sessionStorage.
"use strict";

const KEY = "lily.conversations.v1";
const CURRENT = "lily.current";
const SETTINGS = "lily.settings";
const TITLE_CHARS = 60;

function validMessage(m) {
  return m && typeof m === "object" && ["user", "assistant"].includes(m.role) && typeof m.content === "string";
}

function validConversation(c) {
  return c && typeof c === "object" && typeof c.id === "string" && Array.isArray(c.messages) &&
    c.messages.every(validMessage);
}

export function titleOf(conversation) {
  const first = conversation.messages.find((m) => m.role === "user");
  const text = first ? first.content.replace(/\s+/g, " ").trim() : "";
  if (!text) return "New chat";
  return text.length > TITLE_CHARS ? text.slice(0, TITLE_CHARS - 1) + "…" : text;
}

export function newConversation() {
  const id = Date.now().toString(36) + "-" + Math.random().toString(36).slice(2, 8);
  return { id, title: "New chat", updated: Date.now(), messages: [] };
}

export class Store {
  constructor(storage = window.localStorage) {
    this.storage = storage;
  }

  // All conversations, most recent first; an unreadable entry is skipped, not fatal.
  list() {
    try {
      const value = JSON.parse(this.storage.getItem(KEY) || "[]");
      return Array.isArray(value) ? value.filter(validConversation) : [];
    } catch {
      return [];
    }
  }

  get(id) {
    return this.list().find((c) => c.id === id) || null;
  }

  // Writes `conversation` first in the list (an empty one is not kept). Returns how many old ones were dropped
  // to make room.
  save(conversation) {
    conversation.title = titleOf(conversation);
    conversation.updated = Date.now();
    const others = this.list().filter((c) => c.id !== conversation.id);
    const all = conversation.messages.length ? [conversation, ...others] : others;
    for (let dropped = 0; ; ++dropped) {
      try {
        this.storage.setItem(KEY, JSON.stringify(all));
        return dropped;
      } catch (e) {
        if (all.length <= 1) throw e;  // the conversation alone does not fit
        all.pop();
      }
    }
  }

  remove(id) {
    this.storage.setItem(KEY, JSON.stringify(this.list().filter((c) => c.id !== id)));
  }

  currentId() {
    return this.storage.getItem(CURRENT);
  }

  setCurrentId(id) {
    this.storage.setItem(CURRENT, id);
  }

  settings() {
    try {
      return JSON.parse(this.storage.getItem(SETTINGS) || "{}") || {};
    } catch {
      return {};
    }
  }

  saveSettings(values) {
    this.storage.setItem(SETTINGS, JSON.stringify(values));
  }
}
