// The infx operator page: reads /admin/status (and its live form, /admin/events) and nothing else.
// The admin key, when the gateway asks for one, is kept in this tab's sessionStorage and sent as a
// bearer header; never in a URL. Every value is written as text (no HTML is built from data).
"use strict";

const KEY = "infx-admin-key";
const RETRY_MS = 2000;
let latest = null;

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

function fixed(value, digits) { return value === null || value === undefined ? "–" : value.toFixed(digits); }
function percent(value) { return value === null || value === undefined ? "–" : Math.round(value * 100) + " %"; }
function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? Math.round(value * 1000) + " ms" : value.toFixed(2) + " s";
}
function clock(unix) { return unix ? new Date(unix * 1000).toLocaleTimeString() : "–"; }
function state(text, cls) { return el("span", { class: "state-" + (cls || text).replace(/ /g, "-") }, text); }

// --- the live connection -----------------------------------------------------------------

function showLogin(reason) {
  $("login-reason").textContent = reason;
  $("login").hidden = false;
  $("view").hidden = true;
  $("key").focus();
}

function setLive(on) {
  $("live").textContent = on ? "live" : "offline";
  $("live").className = "badge " + (on ? "on" : "off");
}

async function follow() {
  let response;
  try {
    response = await fetch("events", { headers: headers(), cache: "no-store" });
  } catch (error) {
    setLive(false);
    setTimeout(follow, RETRY_MS);
    return;
  }
  if (response.status === 401 || response.status === 403) {
    setLive(false);
    showLogin(response.status === 401 ? "This gateway asks for an admin API key."
                                      : "That key is not an admin key; give an admin key.");
    return;
  }
  if (!response.ok) {
    setLive(false);
    setTimeout(follow, RETRY_MS);
    return;
  }
  $("login").hidden = true;
  $("forget").hidden = !sessionStorage.getItem(KEY);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const kind = (block.match(/^event: ?(.*)$/m) || [])[1];
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
        if (kind === "status" && data.length) {
          setLive(true);
          render(JSON.parse(data.join("\n")));
        }
      }
    }
  } catch (error) {
    // The connection broke: reconnect below.
  }
  setLive(false);
  setTimeout(follow, RETRY_MS);
}

// --- rendering -------------------------------------------------------------------------------

function fill(tableId, rows) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren(...rows);
  if (!rows.length) {
    const columns = $(tableId).tHead.rows[0].cells.length;
    body.append(el("tr", {}, el("td", { colSpan: columns, class: "muted" }, "none")));
  }
}

function render(status) {
  latest = status;
  $("view").hidden = false;
  const me = status.gateway;
  $("gateway").replaceChildren(el("b", {}, me.pod), " ", state(me.state), " ",
                               el("span", { class: "muted" }, "v" + me.version + ", " + me.routing_policy));
  $("scope").textContent = status.scope === null ? "whole cluster" : "tenant " + status.scope;
  renderGateways(status);
  renderEngines(status);
  renderModels(status);
  renderTenants(status);
  renderCharts(status.series);
  renderFailures(status);
}

function renderGateways(status) {
  fill("gateways", Object.entries(status.gateways).map(([pod, g]) => {
    const t = g.status_traffic;
    return el("tr", { "data-gateway": pod },
      el("td", {}, g.self ? el("b", {}, pod, " (this one)") : pod),
      el("td", {}, g.address || "–"), el("td", {}, state(g.state)), el("td", {}, g.dial || "–"),
      el("td", {}, g.last_report_age_seconds === null ? "–" : seconds(g.last_report_age_seconds) + " ago"),
      el("td", {}, t.reports_received + " / " + t.reports_sent),
      el("td", {}, t.bytes_received + " / " + t.bytes_sent),
      el("td", {}, g.engines), el("td", {}, g.forwarded_in_flight));
  }));
}

function engineState(e) {
  if (e.draining) return state("draining");
  if (e.busy_until !== null) return state("busy");
  return e.routable ? state("ready") : state("not ready");
}

// The runtime's own hit rate where it exports one (vLLM, SGLang); else what its answers said since the agent
// started (llama.cpp's timings), with what slot keeping restored.
function cacheHits(e) {
  if (e.load && e.load.prefix_cache_hit_rate !== null) return percent(e.load.prefix_cache_hit_rate);
  let prompt = 0, cached = 0;
  for (const m of e.models) {
    if (m.prompt_cache) { prompt += m.prompt_cache.prompt_tokens; cached += m.prompt_cache.cached_tokens; }
  }
  const share = prompt ? percent(cached / prompt) : "–";
  const kept = e.slot_keeping;
  if (!kept) return share;
  return share + (kept.off ? " (slots not kept)" : " (" + kept.restored + " restored)");
}

function renderEngines(status) {
  const rows = [];
  for (const [tenant, t] of Object.entries(status.tenants)) {
    for (const [name, e] of Object.entries(t.engines)) {
      const runtime = e.runtime ? [e.runtime.kind, e.runtime.version].filter(Boolean).join(" ") : "";
      const models = e.models.map((m) => m.id + (m.ready ? "" : " (loading)")).join(", ");
      const adapters = e.adapters.length ? " + " + e.adapters.join(", ") : "";
      const load = e.load;
      rows.push(el("tr", { "data-engine": name, "data-gateway": e.gateway },
        el("td", {}, name), el("td", {}, tenant),
        el("td", {}, e.gateway, e.locality === "local" ? "" : el("span", { class: "muted" }, " (peer)")),
        el("td", {}, engineState(e)), el("td", {}, runtime || "–"),
        el("td", { class: "wrap" }, models + adapters), el("td", {}, e.tasks.length),
        el("td", {}, load ? load.running + " / " + load.waiting : "–"),
        el("td", {}, load ? percent(load.kv_cache_usage) : "–"),
        el("td", {}, cacheHits(e)),
        el("td", {}, e.slots.used + (e.slots.cap === null ? "" : " / " + e.slots.cap))));
    }
  }
  fill("engines", rows);
}

function renderModels(status) {
  const rows = [];
  for (const [tenant, t] of Object.entries(status.tenants)) {
    for (const [model, m] of Object.entries(t.models)) {
      const s = m.scaler;
      const scaler = s ? s.deployment + ": " + s.available_replicas + "/" + s.replicas + " replicas, wants "
        + (s.desired_replicas === null ? "–" : s.desired_replicas) + ", " + s.phase
        + (s.held ? ", " + s.held + " held" : "") : "–";
      rows.push(el("tr", { "data-model": model },
        el("td", {}, model), el("td", {}, tenant), el("td", {}, state(m.state)),
        el("td", {}, m.engines_ready + " / " + m.engines), el("td", {}, m.waiting), el("td", {}, m.in_flight),
        el("td", {}, scaler)));
    }
  }
  fill("models", rows);
}

function renderTenants(status) {
  fill("tenants", Object.entries(status.tenants).map(([tenant, t]) => {
    const share = Object.entries(t.slot_share).map(([caller, s]) => caller + " " + percent(s)).join(", ");
    const mix = Object.entries(t.criticality).filter(([, n]) => n).map(([c, n]) => c + " " + n).join(", ");
    return el("tr", { "data-tenant": tenant },
      el("td", {}, tenant), el("td", {}, t.in_flight), el("td", {}, t.waiting),
      el("td", { class: "wrap" }, share || "–"), el("td", {}, mix || "–"), el("td", {}, t.rate_limit_refusals));
  }));
}

// --- charts: small SVG line charts, one figure per measure ------------------------------------

const SVG = "http://www.w3.org/2000/svg";

function chart(title, lines, format) {
  const width = 300, height = 70, pad = 2;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const values = lines.flatMap((l) => l.values.filter((v) => v !== null));
  const top = Math.max(...values, 0) || 1;
  lines.forEach((line, i) => {
    const n = line.values.length;
    const points = [];
    line.values.forEach((v, x) => {
      if (v === null) return;
      const px = n > 1 ? (x / (n - 1)) * width : width;
      points.push(px.toFixed(1) + "," + (height - pad - (v / top) * (height - 2 * pad)).toFixed(1));
    });
    if (points.length === 1) {
      // A lone value would be an invisible line: it is drawn as a dot.
      const [cx, cy] = points[0].split(",");
      const dot = document.createElementNS(SVG, "circle");
      dot.setAttribute("cx", cx);
      dot.setAttribute("cy", cy);
      dot.setAttribute("r", "1.5");
      dot.setAttribute("class", "s" + (i % 4));
      svg.append(dot);
      return;
    }
    const poly = document.createElementNS(SVG, "polyline");
    poly.setAttribute("points", points.join(" "));
    poly.setAttribute("class", "s" + (i % 4));
    svg.append(poly);
  });
  const label = document.createElementNS(SVG, "text");
  label.setAttribute("x", "3");
  label.setAttribute("y", "10");
  label.textContent = "max " + format(top);
  svg.append(label);
  const last = (l) => [...l.values].reverse().find((v) => v !== null);
  const legend = lines.map((l, i) => el("span", { class: "s" + (i % 4) },
    l.name + " " + (last(l) === undefined ? "–" : format(last(l)))));
  return el("figure", {}, el("figcaption", {}, el("b", {}, title), legend), svg);
}

function renderCharts(series) {
  const minutes = Math.round((series.buckets * series.bucket_seconds) / 60);
  $("window").textContent = `(${minutes} min, ${series.bucket_seconds} s buckets, requests that reached this gateway)`;
  const rate = (v) => fixed(v, 2) + "/s";
  $("charts").replaceChildren(...series.models.map((m) => {
    const routing = Object.entries(m.routing_per_second).map(([name, values]) => ({ name, values }));
    return el("div", { class: "model", "data-series": m.tenant + "/" + m.model },
      el("h3", {}, m.model, el("span", { class: "muted" }, " · " + m.tenant)),
      chart("requests", [{ name: "all", values: m.requests_per_second },
                         { name: "errors", values: m.errors_per_second }], rate),
      chart("tokens", [{ name: "out", values: m.output_tokens_per_second },
                       { name: "in", values: m.input_tokens_per_second }], rate),
      chart("time to first token", [{ name: "p50", values: m.ttft_p50_seconds },
                                    { name: "p99", values: m.ttft_p99_seconds }], seconds),
      routing.length ? chart("routing", routing, rate) : null);
  }));
  if (!series.models.length) $("charts").append(el("p", { class: "muted" }, "no request yet"));
}

// --- requests: the failures and the search ----------------------------------------------------

function route(r) {
  const hops = [el("span", { class: "hop" }, "gateway " + r.route.gateway)];
  if (r.route.peer) hops.push("→", el("span", { class: "hop" }, "peer " + r.route.peer));
  hops.push("→", el("span", { class: "hop" }, r.route.engine ? "engine " + r.route.engine : "no engine"));
  return el("div", { class: "route" }, hops);
}

function find(id) {
  $("request-id").value = id;
  $("found").replaceChildren(el("p", { class: "muted" }, "looking…"));
  fetch("status?request=" + encodeURIComponent(id), { headers: headers(), cache: "no-store" })
    .then((response) => response.json())
    .then((status) => showFound(id, status.request))
    .catch((error) => $("found").replaceChildren(el("p", {}, "search failed: " + error)));
}

function showFound(id, r) {
  if (!r) {
    $("found").replaceChildren(el("p", { id: "not-found" }, `No request ${id} in this gateway's memory.`));
    return;
  }
  const outcome = r.state === "in_progress" ? "in progress"
    : r.status + (r.error ? " " + r.error : "") + (r.detail ? ": " + r.detail : "");
  const fact = (name, value) => [el("span", { class: "muted" }, name), el("span", {}, value)];
  $("found").replaceChildren(el("div", { id: "found-request", "data-request": r.request_id },
    route(r),
    el("div", { class: "facts" },
      fact("request", r.request_id), fact("tenant", r.tenant), fact("model", r.model + " (" + r.endpoint + ")"),
      fact("outcome", outcome), fact("queue wait", seconds(r.queued_seconds)), fact("retries", r.retries),
      fact("first token", seconds(r.first_token_seconds)), fact("latency", seconds(r.latency_seconds)),
      fact("tokens in / out", (r.tokens_in ?? "–") + " / " + (r.tokens_out ?? "–")),
      fact("started", clock(r.started_at)))));
}

function renderFailures(status) {
  fill("failures", status.failures.map((r) => {
    const link = el("a", { class: "request" }, r.request_id);
    link.addEventListener("click", () => find(r.request_id));
    return el("tr", {},
      el("td", {}, clock(r.ended_at)), el("td", {}, link), el("td", {}, r.tenant), el("td", {}, r.model),
      el("td", {}, r.status), el("td", { class: "wrap" }, (r.error || "") + (r.detail ? ": " + r.detail : "")),
      el("td", {}, [r.route.peer, r.route.engine].filter(Boolean).join(" → ") || "–"));
  }));
}

// --- start --------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    $("login").hidden = true;
    follow();
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    location.reload();
  });
  $("search").addEventListener("submit", (event) => {
    event.preventDefault();
    find($("request-id").value.trim());
  });
  follow();
});
