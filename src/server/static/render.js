// Model output to DOM nodes that cannot run anything. Three layers:
//  1. marked (Debian's libjs-marked) renders the markdown with a renderer that escapes every raw HTML tag in
//     the source (so `<img onerror=...>` is shown as text), keeps only http(s)/mailto links, and shows images
//     as links (nothing is fetched);
//  2. the HTML is parsed in an inert document (DOMParser: no script runs, nothing loads) and only an allowlist
//     of elements and attributes is kept;
//  3. the page's Content-Security-Policy allows no inline script at all.
// Code blocks are highlighted by highlight.js (libjs-highlight.js) and get a Copy button. Without the libraries
// (lily built without those packages) the text is shown as it is.
"use strict";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);

// Languages tried when a code block names none (all ~190 would be slow and guess oddly).
const AUTO_LANGUAGES = ["python", "javascript", "typescript", "bash", "shell", "cpp", "c", "rust", "go", "java",
  "json", "yaml", "sql", "html", "xml", "css", "markdown", "diff", "ini", "makefile", "cmake", "dockerfile"];
const MAX_AUTO_BYTES = 20000;

const TAGS = new Set(["p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "del", "code", "pre",
  "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td", "span", "input"]);
const ATTRS = { a: ["href", "title"], ol: ["start"], th: ["align"], td: ["align"], code: ["class"],
  span: ["class"], input: ["type", "checked", "disabled"] };

export function safeUrl(href) {
  try {
    const url = new URL(String(href), window.location.href);
    return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

// A streamed answer is rendered again at each frame: finished code blocks are not highlighted again.
const highlighted = new Map();
const MAX_CACHED = 64;

function highlight(code, lang) {
  const key = lang + "\0" + code;
  if (highlighted.has(key)) return highlighted.get(key);
  const html = highlightNow(code, lang);
  if (highlighted.size >= MAX_CACHED) highlighted.delete(highlighted.keys().next().value);
  highlighted.set(key, html);
  return html;
}

// highlight.js 9 (Debian 12) takes (language, code); 10 and later (code, {language}).
function highlightNow(code, lang) {
  const hljs = window.hljs;
  if (!hljs) return null;
  const modern = typeof hljs.versionString === "string" && parseInt(hljs.versionString, 10) >= 10;
  try {
    if (lang && hljs.getLanguage(lang)) {
      return modern ? hljs.highlight(code, { language: lang, ignoreIllegals: true }).value
        : hljs.highlight(lang, code, true).value;
    }
    if (code.length > MAX_AUTO_BYTES) return null;
    return hljs.highlightAuto(code, AUTO_LANGUAGES).value;
  } catch {
    return null;
  }
}

// marked's renderer methods, for the positional arguments of marked 4-12 and the token objects of 13+.
function makeRenderer(marked) {
  const r = new marked.Renderer();
  r.html = (html) => escapeHtml(typeof html === "object" ? html.text : html);
  r.code = (code, info) => {
    if (typeof code === "object") [code, info] = [code.text, code.lang];
    const lang = String(info || "").trim().split(/\s+/)[0].toLowerCase().replace(/[^a-z0-9_+#.-]/g, "");
    const body = highlight(code, lang) ?? escapeHtml(code);
    return '<pre><code class="hljs' + (lang ? " language-" + lang : "") + '">' + body + "</code></pre>\n";
  };
  r.link = function (href, title, text) {
    if (typeof href === "object") [href, title, text] = [href.href, href.title, this.parser.parseInline(href.tokens)];
    const url = safeUrl(href);
    if (!url) return text;
    return '<a href="' + escapeHtml(url) + '"' + (title ? ' title="' + escapeHtml(title) + '"' : "") + ">" + text + "</a>";
  };
  r.image = (href, title, text) => {
    if (typeof href === "object") [href, title, text] = [href.href, href.title, href.text];
    const label = escapeHtml("image: " + (text || href));
    const url = safeUrl(href);
    return url ? '<a href="' + escapeHtml(url) + '">' + label + "</a>" : label;
  };
  return r;
}

let renderer = null;

function toHtml(text) {
  const marked = window.marked;
  if (!renderer) renderer = makeRenderer(marked);
  return marked.parse(text, { renderer, gfm: true, mangle: false, headerIds: false });
}

function allowedClass(tag, value) {
  const classes = value.split(/\s+/).filter(Boolean);
  if (tag === "span") return classes.every((c) => c.startsWith("hljs-"));
  return classes.every((c) => c === "hljs" || c.startsWith("language-"));
}

// Keeps the allowlisted elements and attributes; anything else becomes its text.
function clean(node) {
  for (const child of [...node.childNodes]) {
    if (child.nodeType === Node.TEXT_NODE) continue;
    if (child.nodeType !== Node.ELEMENT_NODE) {
      child.remove();
      continue;
    }
    const tag = child.tagName.toLowerCase();
    if (!TAGS.has(tag) || (tag === "input" && child.getAttribute("type") !== "checkbox")) {
      child.replaceWith(document.createTextNode(child.textContent));
      continue;
    }
    for (const attr of [...child.attributes]) {
      const ok = (ATTRS[tag] || []).includes(attr.name) &&
        (attr.name !== "href" || safeUrl(attr.value) !== null) &&
        (attr.name !== "class" || allowedClass(tag, attr.value));
      if (!ok) child.removeAttribute(attr.name);
    }
    if (tag === "a") {
      child.target = "_blank";
      child.rel = "noopener noreferrer";
    }
    if (tag === "input") child.disabled = true;
    clean(child);
  }
}

// Each <pre> in a box with its language and a Copy button (handled by copyButtonClicked).
function decorateCodeBlocks(root) {
  for (const pre of root.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    const lang = code ? [...code.classList].find((c) => c.startsWith("language-")) : null;
    const box = document.createElement("div");
    box.className = "codeblock";
    const bar = document.createElement("div");
    bar.className = "codebar";
    const label = document.createElement("span");
    label.textContent = lang ? lang.slice("language-".length) : "code";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    bar.append(label, copy);
    pre.replaceWith(box);
    box.append(bar, pre);
  }
}

export const rendersMarkdown = () => typeof window.marked === "object" && typeof window.marked.parse === "function";

// The markdown `text` as a fragment of safe nodes (plain text when marked is not there).
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  if (!rendersMarkdown()) {
    const plain = document.createElement("div");
    plain.className = "plain";
    plain.textContent = text;
    fragment.append(plain);
    return fragment;
  }
  const doc = new DOMParser().parseFromString("<!doctype html><body></body>", "text/html");
  doc.body.innerHTML = toHtml(text);  // an inert document: nothing here runs or loads
  clean(doc.body);
  decorateCodeBlocks(doc.body);
  fragment.append(...[...doc.body.childNodes].map((n) => document.adoptNode(n)));
  return fragment;
}

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);  // a secure context (localhost, https) only
    return true;
  } catch {
    const area = document.createElement("textarea");
    area.value = text;
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch {
      ok = false;
    }
    area.remove();
    return ok;
  }
}

// A click anywhere in the log: copies the code block whose Copy button it was.
export async function copyButtonClicked(event) {
  const button = event.target.closest(".codeblock .copy");
  if (!button) return;
  const code = button.closest(".codeblock").querySelector("pre");
  const ok = await copyText(code.textContent);
  button.textContent = ok ? "Copied" : "Copy failed";
  setTimeout(() => (button.textContent = "Copy"), 1500);
}
