// The page: one poll of /ui/api/state a second for the Models, Now and Requests views, and a
// streaming chat for the Playground. Model output is only ever set as text (textContent),
// never parsed as HTML.
"use strict";

const POLL_MS = 1000;
const HISTORY = 300; // samples kept per chart: five minutes at one a second
const KEY_STORE = "llm-server-api-key";

const $ = (id) => document.getElementById(id);
let apiKey = sessionStorage.getItem(KEY_STORE) || "";
let latest = null; // the last poll's body
const samples = []; // {t, tps, running, queued, ttft{}, itl{}, cache}
let previous = null; // the last poll's counters, for rates

// el("td", {className: "num"}, "text", child): strings become text nodes, never markup
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props || {});
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

class Unauthorized extends Error {}

// fetch with the API key sent as the API takes it; a 401 asks for the key
async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (apiKey) headers.set("Authorization", "Bearer " + apiKey);
  const response = await fetch(path, { ...options, headers, credentials: "same-origin" });
  if (response.status === 401) {
    askForKey(apiKey ? "That key was refused." : "");
    throw new Unauthorized("a valid API key is required");
  }
  return response;
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message;
  setConnection("API key needed", true);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORE, apiKey);
  $("key-form").hidden = true;
  poll();
});

function setConnection(text, bad) {
  const node = $("connection");
  node.textContent = text;
  node.classList.toggle("bad", Boolean(bad));
}

// -- views ------------------------------------------------------------------------------------

function show(view) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab.dataset.view === view);
  }
  for (const section of document.querySelectorAll(".view")) {
    section.hidden = section.id !== "view-" + view;
  }
  if (view === "now") drawCharts();
  if (view === "requests") poll();
  location.hash = view;
}

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => show(tab.dataset.view));
}

function formatBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function formatAgo(seconds) {
  if (!seconds) return "–";
  const ago = Math.max(0, Date.now() / 1000 - seconds);
  if (ago < 60) return Math.round(ago) + " s ago";
  if (ago < 3600) return Math.round(ago / 60) + " min ago";
  return Math.round(ago / 3600) + " h ago";
}

function ms(seconds) {
  return seconds === null || seconds === undefined ? "–" : Math.round(seconds * 1000) + " ms";
}

function renderModels(state) {
  const budget = state.memory.budget;
  const used = state.memory.used;
  $("memory-fill").style.width = budget ? Math.min(100, (100 * used) / budget) + "%" : "0";
  $("memory-text").textContent = budget
    ? formatBytes(used) + " of " + formatBytes(budget) + " budget · process " + formatBytes(state.memory.rss)
    : "process " + formatBytes(state.memory.rss);
  // a row is rebuilt only when what it shows changed, so a button is never swapped under a click
  const shown = new Map([...$("models-body").children].map((row) => [row.dataset.model, row]));
  const rows = state.models.map((model) => {
    const signature = JSON.stringify([model, budget, formatAgo(model.last_used)]);
    const old = shown.get(model.id);
    if (old && old.dataset.signature === signature) return old;
    const row = modelRow(model, budget);
    row.dataset.signature = signature;
    return row;
  });
  if (rows.some((row, i) => $("models-body").children[i] !== row) || rows.length !== shown.size) {
    $("models-body").replaceChildren(...rows);
  }
  const picker = $("chat-model");
  const ids = state.models.map((m) => m.id);
  if (picker.options.length !== ids.length || [...picker.options].some((o, i) => o.value !== ids[i])) {
    const chosen = picker.value;
    picker.replaceChildren(...ids.map((id) => el("option", { value: id }, id)));
    if (ids.includes(chosen)) picker.value = chosen;
  }
}

function modelRow(model, budget) {
  const status = el("td", {}, el("span", { className: "badge status-" + model.status }, model.status));
  if (model.error) status.append(el("div", { className: "error" }, model.error));
  const fill = el("div", { className: "fill" });
  fill.style.width = budget && model.bytes ? Math.min(100, (100 * model.bytes) / budget) + "%" : "0";
  const bar = el("div", { className: "bar", title: memoryTitle(model) }, fill);
  const memory = el("td", { className: "memory" }, bar, " ", model.bytes ? formatBytes(model.bytes) : "–");
  const actions = el("td", {});
  if (model.manageable) {
    const busy = model.status === "loading" || model.status === "unloading";
    const loaded = model.status === "loaded";
    actions.append(
      el("button", { type: "button", disabled: busy || loaded, onclick: () => act(model.id, "load") }, "Load"),
      el("button", { type: "button", disabled: busy || !loaded || model.pinned, onclick: () => act(model.id, "unload") }, "Unload"),
    );
  }
  const row = el(
    "tr", {},
    el("td", {}, model.id, model.source ? el("div", { className: "detail" }, model.source) : null),
    status,
    memory,
    el("td", { className: "num" }, model.context_length || "–"),
    el("td", {}, formatAgo(model.last_used)),
    el("td", { className: "num" }, model.active_requests),
    actions,
  );
  row.dataset.model = model.id;
  row.dataset.status = model.status;
  return row;
}

function memoryTitle(model) {
  const m = model.memory;
  if (!m) return "";
  return "weights " + formatBytes(m.weights) + ", KV " + formatBytes(m.kv) + ", prefix cache " + formatBytes(m.prefix_cache);
}

// load and unload: POSTs with the key; the poll shows the status change
async function act(id, action) {
  $("model-action-error").textContent = "";
  const path = "/v1/models/" + id.split("/").map(encodeURIComponent).join("/") + "/" + action;
  try {
    const pending = api(path, { method: "POST" });
    setTimeout(poll, 100); // show "loading" while the POST waits for the load
    const response = await pending;
    const body = response.ok ? {} : await response.json().catch(() => ({}));
    const error = body.error || {};
    // a failed load shows in its row; other refusals (busy, too large, ...) show here
    if (!response.ok && error.code !== "model_load_failed") {
      $("model-action-error").textContent = action + " " + id + ": " + (error.message || response.status);
    }
  } catch (error) {
    if (!(error instanceof Unauthorized)) $("model-action-error").textContent = String(error);
  }
  poll();
}

function renderRequests(state) {
  $("requests-source").textContent = state.requests_source || "nowhere: the page is off";
  const rows = state.requests.map((r) => {
    const failed = r.status >= 400;
    const row = el(
      "tr", { className: failed ? "http-error" : "" },
      el("td", {}, new Date(r.time * 1000).toLocaleTimeString()),
      el("td", {}, r.route),
      el("td", {}, r.model || "–"),
      el("td", { className: "num" }, r.status),
      el("td", { className: "num" }, r.prompt_tokens === null ? "–" : r.prompt_tokens + " → " + r.completion_tokens),
      el("td", { className: "num" }, ms(r.ttft)),
      el("td", { className: "num" }, ms(r.duration)),
      el("td", {}, r.reason || ""),
    );
    row.dataset.status = r.status;
    return row;
  });
  $("requests-body").replaceChildren(...rows);
}

// -- Now: rates from counter differences, charts on canvases ----------------------------------

function sample(state) {
  const now = state.now;
  const point = {
    t: state.time,
    tps: null,
    running: now.running,
    queued: now.queued,
    ttft: now.ttft || {},
    itl: now.inter_token || {},
    cache: null,
  };
  if (previous) {
    const dt = state.time - previous.time;
    const tokens = now.generated_tokens - previous.now.generated_tokens;
    // a model unloaded takes its counts with it: a negative difference is no rate
    if (dt > 0 && tokens >= 0) point.tps = tokens / dt;
    if (now.prefix_hits !== null && previous.now.prefix_hits !== null) {
      const hits = now.prefix_hits - previous.now.prefix_hits;
      const lookups = hits + now.prefix_misses - previous.now.prefix_misses;
      point.cache = lookups > 0 ? (100 * hits) / lookups : null;
    }
  }
  previous = state;
  samples.push(point);
  if (samples.length > HISTORY) samples.shift();
}

const SERIES_COLORS = ["#2f6fde", "#c27c0e", "#c8372d"];
const SPAN_MIN = 30; // the x axis covers at least half a minute, then grows to HISTORY samples

// series: [{label, values}], newest value last; `top`: a fixed top of the y axis (else the max)
function drawChart(canvas, series, unit, top) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (!width || !height) return;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  g.clearRect(0, 0, width, height);
  const values = series.flatMap((s) => s.values).filter((v) => v !== null && Number.isFinite(v));
  const yMax = top || Math.max(1e-9, ...values) * 1.15;
  const span = Math.max(SPAN_MIN, samples.length);
  const pad = 18;
  g.strokeStyle = "rgba(127,127,127,.35)";
  g.beginPath();
  g.moveTo(0, height - pad + 0.5);
  g.lineTo(width, height - pad + 0.5);
  g.stroke();
  g.fillStyle = "rgba(127,127,127,.9)";
  g.font = "11px system-ui, sans-serif";
  g.fillText(values.length ? yMax.toFixed(yMax < 10 ? 1 : 0) + " " + unit : "no data yet", 4, 12);
  const seconds = Math.round((span * POLL_MS) / 1000);
  g.fillText(seconds >= 120 ? "last " + Math.round(seconds / 60) + " min" : "last " + seconds + " s", width - 60, height - 4);
  series.forEach((s, i) => {
    const color = SERIES_COLORS[i % SERIES_COLORS.length];
    if (series.length > 1) {
      g.fillStyle = color;
      g.fillText(s.label, width - 52 * (series.length - i), 12);
    }
    g.strokeStyle = color;
    g.lineWidth = 1.5;
    g.beginPath();
    let drawing = false;
    s.values.forEach((v, j) => {
      if (v === null || !Number.isFinite(v)) { drawing = false; return; }
      const x = width - ((s.values.length - 1 - j) * width) / (span - 1);
      const y = height - pad - (Math.min(v, yMax) / yMax) * (height - pad - 16);
      if (drawing) g.lineTo(x, y); else g.moveTo(x, y);
      drawing = true;
    });
    g.stroke();
  });
}

function drawCharts() {
  if ($("view-now").hidden) return;
  const pick = (f) => samples.map(f);
  const inMs = (v) => (v === null || v === undefined ? null : v * 1000);
  const quantiles = (key) => ["p50", "p90", "p99"].map((q) => ({ label: q, values: pick((p) => inMs(p[key][q])) }));
  drawChart($("chart-tps"), [{ label: "tok/s", values: pick((p) => p.tps) }], "tok/s");
  drawChart($("chart-running"), [
    { label: "running", values: pick((p) => p.running) },
    { label: "queued", values: pick((p) => p.queued) },
  ], "req");
  drawChart($("chart-ttft"), quantiles("ttft"), "ms");
  drawChart($("chart-itl"), quantiles("itl"), "ms");
  drawChart($("chart-cache"), [{ label: "hit %", values: pick((p) => p.cache) }], "%", 100);
  const last = samples[samples.length - 1];
  if (!last) return;
  $("now-tps").textContent = last.tps === null ? "–" : last.tps.toFixed(1);
  $("now-running").textContent = last.running + " / " + last.queued;
  $("now-ttft").textContent = [last.ttft.p50, last.ttft.p90, last.ttft.p99].map(ms).join("  ");
  $("now-itl").textContent = [last.itl.p50, last.itl.p90, last.itl.p99].map(ms).join("  ");
  $("now-cache").textContent = last.cache === null ? "–" : last.cache.toFixed(0) + " %";
}

// -- the poll ---------------------------------------------------------------------------------

let polling = false;

async function poll() {
  if (polling) return;
  polling = true;
  try {
    // the recent requests only while their view is shown (the poll stays small otherwise)
    const shown = $("view-requests").hidden ? 0 : 100;
    const response = await api("/ui/api/state?requests=" + shown);
    if (!response.ok) throw new Error("state: HTTP " + response.status);
    latest = await response.json();
    sample(latest);
    renderModels(latest);
    if (!$("view-requests").hidden) renderRequests(latest);
    drawCharts();
    setConnection(latest.draining ? "draining" : "live", latest.draining);
  } catch (error) {
    if (!(error instanceof Unauthorized)) setConnection("server unreachable", true);
  } finally {
    polling = false;
  }
}

setInterval(() => {
  if (document.visibilityState === "visible") poll();
}, POLL_MS);
window.addEventListener("resize", drawCharts);

// -- Playground -------------------------------------------------------------------------------

let conversation = []; // {role, content, tool_calls?} without the system prompt
let running = null; // the AbortController of the answer streaming now

function messageNode(role) {
  const content = el("div", { className: "content" });
  const node = el("div", { className: "message " + role }, el("div", { className: "role" }, role), content);
  $("transcript").append(node);
  return { node, content };
}

$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});

$("chat-clear").addEventListener("click", () => {
  if (running) running.abort();
  conversation = [];
  $("transcript").replaceChildren();
  $("chat-stats").textContent = "";
});

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  if (running) { running.abort(); return; }
  const text = $("chat-input").value.trim();
  if (!text) return;
  $("chat-input").value = "";
  conversation.push({ role: "user", content: text });
  messageNode("user").content.textContent = text;
  answer().catch((error) => {
    if (!(error instanceof Unauthorized)) $("chat-stats").textContent = String(error);
  });
});

function chatBody() {
  const system = $("chat-system").value.trim();
  const number = (id) => {
    const value = parseFloat($(id).value);
    return Number.isFinite(value) ? value : undefined;
  };
  return {
    model: $("chat-model").value || undefined,
    messages: system ? [{ role: "system", content: system }, ...conversation] : conversation,
    temperature: number("chat-temperature"),
    top_p: number("chat-top-p"),
    max_tokens: number("chat-max-tokens"),
    stream: true,
    stream_options: { include_usage: true },
  };
}

// the data of each server-sent event of `response`, parsed
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function answer() {
  const out = messageNode("assistant");
  const reasoning = el("details", { className: "reasoning", open: true }, el("summary", {}, "reasoning"));
  const thought = el("div");
  reasoning.append(thought);
  const calls = []; // {name, arguments, node}
  let text = "";
  let usage = null;
  let first = null;
  const started = performance.now();
  running = new AbortController();
  $("chat-send").textContent = "Stop";
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(chatBody()),
      signal: running.signal,
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error("HTTP " + response.status + ": " + ((body.error && body.error.message) || ""));
    }
    for await (const chunk of events(response)) {
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (!delta) continue;
      if (first === null && (delta.content || delta.reasoning_content || delta.tool_calls)) first = performance.now();
      if (delta.reasoning_content) {
        if (!reasoning.isConnected) out.node.insertBefore(reasoning, out.content);
        thought.textContent += delta.reasoning_content;
      }
      if (delta.content) {
        text += delta.content;
        out.content.textContent = text;
      }
      for (const call of delta.tool_calls || []) toolCall(out, calls, call);
      $("transcript").scrollTop = $("transcript").scrollHeight;
    }
  } catch (error) {
    if (error.name !== "AbortError") throw error;
  } finally {
    running = null;
    $("chat-send").textContent = "Send";
  }
  const message = { role: "assistant", content: text };
  if (calls.length) {
    message.tool_calls = calls.map((c, i) => ({
      id: c.id || "call_" + i, type: "function", function: { name: c.name, arguments: c.arguments },
    }));
  }
  conversation.push(message);
  answerStats(usage, started, first);
}

function toolCall(out, calls, delta) {
  let call = calls[delta.index || 0];
  if (!call) {
    call = { id: delta.id, name: "", arguments: "", node: el("div", { className: "tool-call" }) };
    calls[delta.index || 0] = call;
    out.node.append(call.node);
  }
  if (delta.function && delta.function.name) call.name += delta.function.name;
  if (delta.function && delta.function.arguments) call.arguments += delta.function.arguments;
  call.node.textContent = "call " + call.name + "(" + call.arguments + ")";
}

function answerStats(usage, started, first) {
  const seconds = (performance.now() - (first || started)) / 1000;
  const parts = [];
  if (usage) {
    parts.push(usage.prompt_tokens + " prompt tokens", usage.completion_tokens + " answer tokens");
    if (seconds > 0) parts.push((usage.completion_tokens / seconds).toFixed(1) + " tokens/s");
  }
  if (first !== null) parts.push("first token after " + Math.round(first - started) + " ms");
  $("chat-stats").textContent = parts.join(" · ");
}

// -- start ------------------------------------------------------------------------------------

const VIEWS = ["models", "now", "requests", "playground"];
const fromHash = () => (VIEWS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "models");
window.addEventListener("hashchange", () => show(fromHash()));
show(fromHash());
poll();
