// hmoe web UI: chat against this server's OpenAI-compatible API. Plain JavaScript, no build step,
// nothing loaded from the network. Conversations, settings and the API key live in localStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = { chats: "hmoe.chats", settings: "hmoe.settings", key: "hmoe.apiKey", model: "hmoe.model" };
const NUMERIC = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"];

const state = {
  chats: [],          // [{id, title, model, updated, messages: [{role, content, reasoning, timings, stopped, error}]}]
  current: null,      // id of the open conversation
  router: false,      // router mode (several models, /models/load and /models/unload)
  models: [],         // /v1/models data
  model: "",          // the model requests go to
  busy: null,         // {controller, msg} while an answer streams
};

// ---------- storage ----------

function load(key, fallback) {
  try {
    const v = localStorage.getItem(key);
    return v === null ? fallback : JSON.parse(v);
  } catch (_) {
    return fallback;
  }
}
function save(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (e) {
    note("could not save to localStorage: " + e.message);
  }
}
function saveChats() { save(STORE.chats, state.chats); }
function apiKey() { return load(STORE.key, ""); }
function settings() { return load(STORE.settings, {}); }

// ---------- API ----------

function headers() {
  const h = { "Content-Type": "application/json" };
  const k = apiKey();
  if (k) h["Authorization"] = "Bearer " + k;
  return h;
}

async function api(path, body, signal) {
  const init = { method: body === undefined ? "GET" : "POST", headers: headers(), signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  const r = await fetch(path, init);
  if (r.status === 401) {
    askKey(apiKey() ? "The key was not accepted. Enter the server's API key." : null);
    throw new Error("this server needs an API key");
  }
  return r;
}

async function errorText(r) {
  const text = await r.text();
  try {
    const j = JSON.parse(text);
    if (j.error && j.error.message) return j.error.message;
  } catch (_) { /* not JSON */ }
  return text || r.status + " " + r.statusText;
}

// ---------- Markdown (escape first, then a small subset: fences, headings, lists, quotes,
// tables, rules, emphasis, inline code, http(s) links) ----------

function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function inline(raw) {
  // Code spans are cut out first so that nothing inside them is formatted.
  return raw.split(/(`[^`]+`)/).map((part) => {
    if (part.length > 2 && part.startsWith("`") && part.endsWith("`")) {
      return "<code>" + escapeHtml(part.slice(1, -1)) + "</code>";
    }
    return escapeHtml(part)
      .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>')
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/__(?=\S)([\s\S]*?\S)__/g, "<strong>$1</strong>")
      .replace(/(^|[^*])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|\W)_(?=\S)([^_]*?\S)_(?!\w)/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  }).join("");
}

const FENCE = /^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s*>\s?(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => inline(c.trim()));
}

function startsBlock(lines, i) {
  const l = lines[i];
  return FENCE.test(l) || HEADING.test(l) || RULE.test(l) || QUOTE.test(l) || BULLET.test(l) ||
    NUMBERED.test(l) || (l.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]));
}

// ---------- code highlighting: comments, strings, numbers and keywords of the common
// languages, one pass of one regular expression; everything is escaped ----------

const KEYWORDS = new Set(("as async await break case catch class const continue def default del do elif else " +
  "enum except export extends false fi final finally fn for from func function go if impl import in interface " +
  "is lambda let loop match mod module mut new nil none null package pass pub raise return self static " +
  "struct super switch then this throw true try type typeof use var void where while with yield " +
  "True False None").split(" "));
const HASH_COMMENTS = /^(py|python|sh|bash|shell|zsh|console|ruby|rb|perl|r|yaml|yml|toml|ini|conf|dockerfile|make|makefile|cmake|elixir|nim|julia)$/i;

function highlight(code, lang) {
  const comment = HASH_COMMENTS.test(lang || "") ? "#[^\\n]*" : "\\/\\/[^\\n]*|\\/\\*[\\s\\S]*?(?:\\*\\/|$)";
  const token = new RegExp("(" + comment + ")|(\"(?:\\\\.|[^\"\\\\\\n])*\"?|'(?:\\\\.|[^'\\\\\\n])*'?|`[^`]*`?)" +
    "|(\\b\\d[\\w.]*)|([A-Za-z_][\\w]*)", "g");
  let out = "";
  let at = 0;
  for (const m of code.matchAll(token)) {
    out += escapeHtml(code.slice(at, m.index));
    const kind = m[1] ? "tok-comment" : m[2] ? "tok-string" : m[3] ? "tok-number" : KEYWORDS.has(m[4]) ? "tok-keyword" : null;
    out += kind ? '<span class="' + kind + '">' + escapeHtml(m[0]) + "</span>" : escapeHtml(m[0]);
    at = m.index + m[0].length;
  }
  return out + escapeHtml(code.slice(at));
}

function renderMarkdown(src) {
  const lines = src.replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      const close = m[1];
      const code = [];
      i++;
      while (i < lines.length && !(lines[i].trim().startsWith(close[0].repeat(3)) && lines[i].trim().replace(/[`~]/g, "") === "")) {
        code.push(lines[i]);
        i++;
      }
      i++; // the closing fence (absent while an answer still streams)
      const lang = m[2] ? ' class="language-' + escapeHtml(m[2]) + '"' : "";
      out.push('<pre><button class="copy" type="button">copy</button><code' + lang + ">" + highlight(code.join("\n"), m[2]) + "</code></pre>");
    } else if ((m = line.match(HEADING))) {
      const n = m[1].length;
      out.push("<h" + n + ">" + inline(m[2]) + "</h" + n + ">");
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && (m = lines[i].match(QUOTE))) {
        quoted.push(m[1]);
        i++;
      }
      out.push("<blockquote>" + renderMarkdown(quoted.join("\n")) + "</blockquote>");
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const re = BULLET.test(line) ? BULLET : NUMBERED;
      const tag = re === BULLET ? "ul" : "ol";
      const items = [];
      while (i < lines.length && (m = lines[i].match(re))) {
        let item = m[1];
        i++;
        // Indented continuation lines belong to the item.
        while (i < lines.length && /^\s{2,}\S/.test(lines[i]) && !BULLET.test(lines[i]) && !NUMBERED.test(lines[i])) {
          item += " " + lines[i].trim();
          i++;
        }
        items.push("<li>" + inline(item) + "</li>");
      }
      out.push("<" + tag + ">" + items.join("") + "</" + tag + ">");
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
      const head = cells(line).map((c) => "<th>" + c + "</th>").join("");
      i += 2;
      const rows = [];
      while (i < lines.length && lines[i].includes("|") && lines[i].trim() !== "") {
        rows.push("<tr>" + cells(lines[i]).map((c) => "<td>" + c + "</td>").join("") + "</tr>");
        i++;
      }
      out.push("<table><thead><tr>" + head + "</tr></thead><tbody>" + rows.join("") + "</tbody></table>");
    } else if (line.trim() === "") {
      i++;
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() !== "" && (para.length === 0 || !startsBlock(lines, i))) {
        para.push(inline(lines[i]));
        i++;
      }
      out.push("<p>" + para.join("<br>") + "</p>");
    }
  }
  return out.join("\n");
}

// ---------- conversations ----------

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

function chat() {
  return state.chats.find((c) => c.id === state.current) || null;
}

function newChat() {
  if (state.busy) return;
  const existing = chat();
  if (existing && existing.messages.length === 0) {
    renderChat();
    return;
  }
  const c = { id: newId(), title: "New chat", model: state.model, updated: Date.now(), messages: [] };
  state.chats.unshift(c);
  state.current = c.id;
  saveChats();
  renderList();
  renderChat();
  closeDrawer();
  $("input").focus();
}

function openChat(id) {
  if (state.busy) stop();
  state.current = id;
  const c = chat();
  if (state.router && c && c.model && state.models.some((m) => m.id === c.model)) selectModel(c.model);
  renderList();
  renderChat();
  closeDrawer();
}

function deleteChat(id) {
  if (state.busy && state.current === id) stop();
  state.chats = state.chats.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.chats.length ? state.chats[0].id : null;
  saveChats();
  renderList();
  renderChat();
}

function renderList() {
  const ul = $("chat-list");
  ul.textContent = "";
  for (const c of state.chats) {
    const li = document.createElement("li");
    li.className = "chat-item" + (c.id === state.current ? " active" : "");
    li.dataset.id = c.id;
    const t = document.createElement("span");
    t.className = "title";
    t.textContent = c.title;
    t.title = c.title;
    t.onclick = () => openChat(c.id);
    const del = document.createElement("button");
    del.className = "delete";
    del.type = "button";
    del.title = "Delete";
    del.textContent = "\u00d7";
    del.onclick = () => deleteChat(c.id);
    li.append(t, del);
    ul.append(li);
  }
}

// ---------- messages ----------

function fmtRate(x) {
  return x >= 100 ? x.toFixed(0) : x.toFixed(1);
}

function metaLine(m) {
  const parts = [];
  const t = m.timings;
  if (t) {
    if (t.prompt_n !== undefined) {
      let p = "prompt " + t.prompt_n + " tok";
      if (t.prompt_per_second > 0) p += " at " + fmtRate(t.prompt_per_second) + " t/s";
      if (t.cache_n) p += " (+" + t.cache_n + " cached)";
      parts.push(p);
    }
    if (t.predicted_n !== undefined) {
      let g = "generated " + t.predicted_n + " tok";
      if (t.predicted_per_second > 0) g += " at " + fmtRate(t.predicted_per_second) + " t/s";
      parts.push(g);
    }
  }
  if (m.stopped) parts.push("stopped");
  if (m.model && state.router) parts.push(m.model);
  return parts.join(" \u00b7 ");
}

function messageNode(m, index, last) {
  const div = document.createElement("div");
  div.className = "msg " + m.role;
  div.dataset.index = index;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role === "user" ? "You" : "Assistant";
  div.append(role);
  if (m.role === "assistant" && m.reasoning) {
    const d = document.createElement("details");
    d.className = "reasoning";
    const streamingThoughts = state.busy && state.busy.msg === m && !m.content;
    d.open = streamingThoughts || !!m.reasoningOpen;
    const s = document.createElement("summary");
    // Only the reader's clicks count (setting d.open above fires "toggle" too).
    s.onclick = () => { m.reasoningOpen = !d.open; };
    s.textContent = streamingThoughts ? "Reasoning\u2026" : "Reasoning";
    const body = document.createElement("div");
    body.className = "thoughts";
    body.innerHTML = renderMarkdown(m.reasoning);
    d.append(s, body);
    div.append(d);
  }
  const body = document.createElement("div");
  body.className = "body";
  if (m.role === "user") {
    body.textContent = m.content;
  } else {
    body.innerHTML = renderMarkdown(m.content || "");
    if (state.busy && state.busy.msg === m) body.classList.add("cursor");
  }
  div.append(body);
  if (m.waiting) {
    const w = document.createElement("div");
    w.className = "waiting";
    w.textContent = m.waiting;
    div.append(w);
  }
  if (m.error) {
    const e = document.createElement("div");
    e.className = "error";
    e.textContent = m.error;
    div.append(e);
  }
  const meta = document.createElement("div");
  meta.className = "meta";
  const text = document.createElement("span");
  text.className = "timings";
  text.textContent = m.role === "assistant" ? metaLine(m) : "";
  meta.append(text);
  if (!state.busy && ((m.role === "assistant" && last) || (m.role === "user" && index === lastUserIndex()))) {
    const b = document.createElement("button");
    b.type = "button";
    if (m.role === "assistant") {
      b.className = "regenerate";
      b.textContent = "Regenerate";
      b.onclick = regenerate;
    } else {
      b.className = "edit";
      b.textContent = "Edit";
      b.onclick = () => editFrom(index);
    }
    meta.append(b);
  }
  div.append(meta);
  return div;
}

function lastUserIndex() {
  const c = chat();
  if (!c) return -1;
  for (let i = c.messages.length - 1; i >= 0; i--) if (c.messages[i].role === "user") return i;
  return -1;
}

function renderChat() {
  const box = $("messages");
  const stick = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
  box.textContent = "";
  const c = chat();
  if (!c || c.messages.length === 0) {
    const e = document.createElement("div");
    e.id = "empty";
    e.className = "empty";
    e.innerHTML = "<h1>hmoe</h1><p>Ask something. Conversations stay in this browser.</p>";
    box.append(e);
  } else {
    c.messages.forEach((m, i) => box.append(messageNode(m, i, i === c.messages.length - 1)));
  }
  if (stick || state.busy) box.scrollTop = box.scrollHeight;
  const streaming = !!state.busy;
  $("send").hidden = streaming;
  $("stop").hidden = !streaming;
}

let frame = 0;
function renderSoon() {
  if (frame) return;
  frame = requestAnimationFrame(() => {
    frame = 0;
    renderChat();
  });
}

// ---------- sending ----------

function requestBody(c) {
  const s = settings();
  const messages = [];
  if (s.system && s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of c.messages) {
    // The answer being written (and a failed one) has no content yet: sent, it would be an
    // assistant prefill, which the server continues instead of answering.
    if (m.role === "assistant" && !m.content) continue;
    messages.push({ role: m.role, content: m.content });
  }
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (state.model) body.model = state.model;
  for (const k of NUMERIC) {
    if (s[k] !== undefined && s[k] !== "" && s[k] !== null) body[k] = Number(s[k]);
  }
  if (s.reasoning_effort) body.reasoning_effort = s.reasoning_effort;
  return body;
}

async function send(text) {
  if (state.busy) return;
  if (!chat()) newChat();
  const c = chat();
  if (text !== undefined) {
    c.messages.push({ role: "user", content: text });
    if (c.title === "New chat") c.title = text.replace(/\s+/g, " ").slice(0, 48) || "Chat";
  }
  c.model = state.model;
  c.updated = Date.now();
  const msg = { role: "assistant", content: "", reasoning: "", model: state.model };
  c.messages.push(msg);
  const controller = new AbortController();
  state.busy = { controller, msg };
  saveChats();
  renderList();
  renderChat();
  if (state.router) setModelStatus(state.model, "loading");
  try {
    const r = await postWhenLoaded(c, msg, controller.signal);
    if (!r.ok) {
      msg.error = await errorText(r);
    } else {
      await readStream(r, msg);
    }
  } catch (e) {
    if (e.name === "AbortError") msg.stopped = true;
    else msg.error = e.message || String(e);
  }
  state.busy = null;
  saveChats();
  renderChat();
  if (state.router) refreshModels();
}

// A single-model server answers 503 while its model loads (a router waits by itself): the
// message waits too, with a note, and goes once /health says the model is ready.
async function postWhenLoaded(c, msg, signal) {
  for (let tries = 0; ; tries++) {
    const r = await api("/v1/chat/completions", requestBody(c), signal);
    if (r.status !== 503 || tries >= 2) return r;
    msg.waiting = (await errorText(r)) + "\u2026 the message goes as soon as the model is ready.";
    renderChat();
    const ready = await untilHealthy(signal);
    msg.waiting = null;
    if (!ready) return r;
    renderChat();
  }
}

// Polls /health until it answers 200 (true) or something other than 503 (false).
async function untilHealthy(signal) {
  for (;;) {
    await new Promise((done) => setTimeout(done, 400));
    if (signal.aborted) throw new DOMException("stopped", "AbortError");
    const h = await fetch("/health", { signal });
    if (h.ok) return true;
    if (h.status !== 503) return false;
  }
}

async function readStream(r, msg) {
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let pending = "";
  let lastSave = Date.now();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = pending.indexOf("\n\n")) >= 0) {
      const event = pending.slice(0, cut);
      pending = pending.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data || data === "[DONE]") continue;
      let j;
      try {
        j = JSON.parse(data);
      } catch (_) {
        continue;
      }
      if (j.error) {
        msg.error = j.error.message || JSON.stringify(j.error);
        continue;
      }
      const ch = j.choices && j.choices[0];
      const d = ch && ch.delta;
      if (d) {
        if (d.reasoning_content) msg.reasoning += d.reasoning_content;
        if (d.content) msg.content += d.content;
        if (d.tool_calls) msg.content += "\n\n(tool call: " + JSON.stringify(d.tool_calls) + ")";
      }
      if (j.timings) msg.timings = j.timings;
      if (ch && ch.finish_reason === "length") msg.error = "(stopped at the token limit)";
    }
    if (state.router && msg.content + msg.reasoning !== "") setModelStatus(msg.model, "loaded");
    if (Date.now() - lastSave > 1000) {
      saveChats();
      lastSave = Date.now();
    }
    renderSoon();
  }
}

function stop() {
  if (state.busy) state.busy.controller.abort();
}

function regenerate() {
  const c = chat();
  if (!c || state.busy) return;
  while (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  if (!c.messages.length) return;
  send();
}

function editFrom(index) {
  const c = chat();
  if (!c || state.busy) return;
  const m = c.messages[index];
  c.messages.splice(index);
  saveChats();
  renderChat();
  const input = $("input");
  input.value = m.content;
  autosize();
  input.focus();
}

// ---------- models ----------

function statusOf(m) {
  if (!m.status) return "loaded";
  if (m.status.failed) return "failed";
  return m.status.value || "unloaded";
}

function selectModel(id) {
  state.model = id;
  save(STORE.model, id);
  renderModels();
}

function setModelStatus(id, value) {
  const m = state.models.find((x) => x.id === id);
  if (m && m.status && statusOf(m) !== "loaded") {
    m.status = { value };
    renderModels();
  }
}

function renderModels() {
  const name = $("model-name");
  const badge = $("model-status");
  const current = state.models.find((m) => m.id === state.model);
  name.textContent = state.model || (state.router ? "choose a model" : "\u2026");
  const st = current ? statusOf(current) : "";
  badge.textContent = state.router ? st : "";
  badge.className = "badge " + st;
  $("model-button").disabled = !state.router;
  const ul = $("model-list");
  ul.textContent = "";
  for (const m of state.models) {
    const s = statusOf(m);
    const li = document.createElement("li");
    li.className = "model-item" + (m.id === state.model ? " selected" : "");
    li.dataset.id = m.id;
    li.dataset.status = s;
    const pick = document.createElement("button");
    pick.type = "button";
    pick.className = "pick";
    pick.textContent = m.id;
    pick.title = m.status && m.status.message ? m.status.message : m.id;
    pick.onclick = () => {
      selectModel(m.id);
      togglePanel(false);
    };
    const badge2 = document.createElement("span");
    badge2.className = "badge status " + s;
    badge2.textContent = s;
    const act = document.createElement("button");
    act.type = "button";
    act.className = "act " + (s === "loaded" ? "unload" : "load");
    act.textContent = s === "loaded" ? "Unload" : "Load";
    act.disabled = s === "loading";
    act.onclick = () => loadOrUnload(m.id, s === "loaded" ? "unload" : "load");
    li.append(pick, badge2, act);
    ul.append(li);
  }
}

async function loadOrUnload(id, what) {
  if (what === "load") setModelStatus(id, "loading");
  try {
    const r = await api("/models/" + what, { model: id });
    if (!r.ok) note(what + " " + id + ": " + (await errorText(r)));
  } catch (e) {
    note(what + " " + id + ": " + e.message);
  }
  await refreshModels();
}

async function refreshModels() {
  try {
    const r = await api("/v1/models");
    if (!r.ok) throw new Error(await errorText(r));
    state.models = (await r.json()).data || [];
  } catch (e) {
    note("models: " + e.message);
    return;
  }
  if (!state.router && state.models.length) state.model = state.models[0].id;
  if (state.router && !state.models.some((m) => m.id === state.model)) {
    const loaded = state.models.find((m) => statusOf(m) === "loaded");
    state.model = loaded ? loaded.id : state.models.length ? state.models[0].id : "";
  }
  renderModels();
}

function togglePanel(open) {
  const p = $("model-panel");
  const show = open === undefined ? p.hidden : open;
  p.hidden = !show;
  $("model-button").setAttribute("aria-expanded", String(show));
  if (show) refreshModels();
}

// ---------- settings, key, layout ----------

function note(text) {
  $("server-note").textContent = text;
}

function fillSettings() {
  const s = settings();
  $("set-system").value = s.system || "";
  for (const k of NUMERIC.concat(["reasoning_effort"])) $("set-" + k).value = s[k] === undefined ? "" : s[k];
  $("set-key").value = apiKey();
}

function storeSettings() {
  const s = { system: $("set-system").value };
  for (const k of NUMERIC.concat(["reasoning_effort"])) {
    const v = $("set-" + k).value;
    if (v !== "") s[k] = v;
  }
  save(STORE.settings, s);
  save(STORE.key, $("set-key").value.trim());
}

function askKey(why) {
  if (why) $("key-why").textContent = why;
  $("key-dialog").hidden = false;
  $("key-input").value = "";
  $("key-input").focus();
}

function closeDrawer() {
  $("app").classList.remove("drawer");
  $("backdrop").hidden = true;
}

function autosize() {
  const t = $("input");
  t.style.height = "auto";
  t.style.height = Math.min(t.scrollHeight + 2, window.innerHeight * 0.4) + "px";
}

async function connect() {
  let r;
  try {
    r = await api("/props");
  } catch (e) {
    note(e.message);
    return;
  }
  if (r.ok) {
    const props = await r.json();
    state.router = props.role === "router";
    note(props.build_info || "");
  } else {
    note(await errorText(r));
  }
  if (state.router) {
    const saved = load(STORE.model, "");
    if (saved) state.model = saved;
  }
  await refreshModels();
}

function init() {
  state.chats = load(STORE.chats, []).filter((c) => c && Array.isArray(c.messages));
  state.current = state.chats.length ? state.chats[0].id : null;
  renderList();
  renderChat();
  fillSettings();

  $("composer").onsubmit = (e) => {
    e.preventDefault();
    const text = $("input").value;
    if (!text.trim() || state.busy) return;
    $("input").value = "";
    autosize();
    send(text);
  };
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("input").addEventListener("input", autosize);
  $("stop").onclick = stop;
  $("new-chat").onclick = newChat;
  $("model-button").onclick = () => togglePanel();
  document.addEventListener("click", (e) => {
    if (!$("model-area").contains(e.target)) $("model-panel").hidden = true;
  });
  $("open-settings").onclick = () => {
    fillSettings();
    $("settings").hidden = false;
    closeDrawer();
  };
  $("close-settings").onclick = () => {
    storeSettings();
    $("settings").hidden = true;
    connect();
  };
  $("settings").addEventListener("change", storeSettings);
  $("key-form").onsubmit = (e) => {
    e.preventDefault();
    save(STORE.key, $("key-input").value.trim());
    $("key-dialog").hidden = true;
    fillSettings();
    connect();
  };
  $("menu").onclick = () => {
    $("app").classList.add("drawer");
    $("backdrop").hidden = false;
  };
  $("backdrop").onclick = closeDrawer;
  $("messages").addEventListener("click", (e) => {
    const b = e.target.closest(".copy");
    if (!b) return;
    const code = b.parentElement.querySelector("code");
    if (navigator.clipboard) navigator.clipboard.writeText(code.textContent).catch(() => {});
    b.textContent = "copied";
    setTimeout(() => { b.textContent = "copy"; }, 1200);
  });
  window.addEventListener("storage", (e) => {
    if (e.key === STORE.chats && !state.busy) {
      state.chats = load(STORE.chats, []);
      renderList();
      renderChat();
    }
  });
  connect();
}

init();
