// fthsdp health dashboard: polls the health API every second and renders replicas (with their
// place in the current quorum), step-time and healthy-replica charts with incidents marked on
// them, the incidents with readable evidence, and the quorum history collapsed to membership
// changes. The bearer token comes from the URL fragment (#token=...), which the browser never
// sends to a server; it is presented as an Authorization header on every call.
// Every value from the API is inserted as text (textContent), never as HTML.
//
// The page is meant to stay open for days: what it accumulates (chart points, incident markers,
// quorum membership rows) is bounded by WINDOW_S and by counts, and DOM nodes the operator may
// have interacted with (an opened evidence disclosure) are kept across polls, not rebuilt.
"use strict";

const POLL_MS = 1000;
const WINDOW_S = 600; // the charts' history: the last 10 minutes
const MIN_SPAN_S = 60; // the charts show at least the last minute, even right after loading
const MAX_POINTS = 2000; // per chart series, beyond the window bound
const MAX_MARKERS = 500;
const MAX_QUORUM_GROUPS = 100;
const STEP_RECORDS = 1000; // the API's bound on one read
const QUORUM_HISTORY = 128; // the API's bound on one read
const KINDS = ["fail_stop", "hang", "slow_rank", "fail_slow", "sdc"];
const PALETTE = ["#0969da", "#bf3989", "#1a7f37", "#9a6700", "#8250df", "#cf222e", "#1b7c83", "#57606a"];

const token = new URLSearchParams(window.location.hash.slice(1)).get("token") || "";

// What the page keeps between polls. Exposed as window.fthsdpDashboard for tests and for an
// operator's console.
const view = {
  now: null, // the service's clock at the latest /v1/replicas
  steps: new Map(), // replica_id -> Map(step -> {t, d}): its step times
  samples: [], // [{t, healthy, known}] sampled from /v1/replicas each poll
  quorums: [], // [{t, members, healthy}] from the quorum history, oldest first
  quorumConfigured: false,
  lastRound: 0, // the highest quorum round already folded in
  groups: [], // quorum history collapsed to membership changes, oldest first
  markers: new Map(), // incident key -> {t, kind, replica_id}
  charts: { steps: null, health: null },
  markersDrawn: 0, // markers the health chart drew last time (for tests)
  polls: 0,
};
window.fthsdpDashboard = view;

// ---- fetching ----------------------------------------------------------------------------

async function api(path) {
  const response = await fetch(path, {
    headers: { Authorization: "Bearer " + token },
    cache: "no-store",
  });
  if (!response.ok) {
    let detail = response.statusText;
    try {
      detail = (await response.json()).detail || detail;
    } catch (_) {
      // not JSON: keep the status text
    }
    throw new Error(response.status + " " + detail);
  }
  return response.json();
}

// ---- small helpers -----------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function ago(now, then) {
  if (then === null || then === undefined) return "–";
  const s = Math.max(0, now - then);
  return s < 60 ? s.toFixed(1) + " s ago" : Math.round(s / 60) + " min ago";
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

function colourOf(name) {
  // A replica keeps its colour when others come and go (the chart is rebuilt then).
  let hash = 0;
  for (const c of name) hash = (hash * 31 + c.codePointAt(0)) >>> 0;
  return PALETTE[hash % PALETTE.length];
}

const kindColours = new Map(); // from the stylesheet's --kind-* properties: one source of colour

function kindColour(kind) {
  if (!kindColours.has(kind)) {
    const css = getComputedStyle(document.documentElement).getPropertyValue("--kind-" + kind).trim();
    kindColours.set(kind, css || "#57606a");
  }
  return kindColours.get(kind);
}

function trimTo(array, max) {
  if (array.length > max) array.splice(0, array.length - max);
}

// ---- evidence: readable fields -------------------------------------------------------------

// At least three significant digits, no more than a reader uses: 0.123, 12.3, 183.
function number(v) {
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a >= 100) return String(Math.round(v));
  if (a >= 0.001) return String(Number(v.toPrecision(3)));
  return v.toExponential(2);
}

// How a key's number reads: the key says the unit (`_s`, `_ms`, a ratio, a point in time).
function unitOf(key) {
  if (/(_at|_since)$/.test(key)) return "time";
  if (/_ms$/.test(key)) return "ms";
  if (/_s$/.test(key)) return "s";
  if (/(^|_)(ratio|residuals?|margin|fraction|frac)$/.test(key)) return "%";
  return "";
}

function formatValue(key, value, detectedAt) {
  const unit = unitOf(key);
  if (typeof value === "number") {
    if (unit === "time") {
      const before = detectedAt - value;
      if (!Number.isFinite(before)) return clock(value);
      return clock(value) + " (" + number(Math.abs(before)) + (before >= 0 ? " s before)" : " s after)");
    }
    if (unit === "%") return number(value * 100) + " %";
    if (unit) return number(value) + " " + unit;
    return number(value);
  }
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (value === null) return "–";
  if (Array.isArray(value)) {
    const shown = value
      .slice(0, 8)
      .map((v) => (typeof v === "object" && v !== null ? JSON.stringify(v) : formatValue(key, v, detectedAt)));
    return shown.join(", ") + (value.length > 8 ? ", … (" + value.length + " in all)" : "");
  }
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

function evidenceNode(incident) {
  const evidence = incident.evidence || {};
  const fields = el("dl", { class: "fields" });
  for (const [key, value] of Object.entries(evidence)) {
    fields.append(
      el("div", { class: "field", "data-key": key },
        el("dt", {}, key),
        el("dd", {}, formatValue(key, value, incident.detected_at)),
      ),
    );
  }
  const raw = el("details", { class: "raw" },
    el("summary", {}, "raw JSON"),
    el("pre", { class: "evidence-raw" }, JSON.stringify(evidence, null, 2)),
  );
  return el("div", { class: "evidence" }, fields, raw);
}

// ---- replicas ------------------------------------------------------------------------------

function quorumPlace(latest, replicaId) {
  if (!view.quorumConfigured) return ["–", "none"];
  if (!latest) return ["no quorum yet", "none"];
  if (!latest.members.includes(replicaId)) return ["not a member", "out"];
  return latest.healthy.includes(replicaId) ? ["member", "in"] : ["member (catching up)", "recovering"];
}

function renderReplicas(data) {
  const body = document.querySelector("#replicas tbody");
  const latest = view.quorums.length ? view.quorums[view.quorums.length - 1] : null;
  const known = new Set(data.replicas.map((r) => r.replica_id));
  const rows = data.replicas.map((r) => {
    const [place, placeClass] = quorumPlace(latest, r.replica_id);
    return el(
      "tr",
      { "data-replica": r.replica_id, "data-state": r.state, "data-quorum": placeClass },
      el("td", {}, r.replica_id),
      el("td", { class: "state state-" + r.state }, r.state),
      el("td", { class: "quorum quorum-" + placeClass }, place),
      el("td", { class: "fail-slow fail-slow-" + (r.fail_slow || "none") }, r.fail_slow || "–"),
      el("td", { class: "step" }, r.last_step),
      el("td", {}, r.ranks),
      el("td", {}, (r.hosts || []).join(", ")),
      el("td", {}, ago(data.now, r.last_seen)),
    );
  });
  // Quorum members the health service never heard from: the table must not hide them.
  for (const id of latest ? latest.members : []) {
    if (known.has(id)) continue;
    rows.push(
      el("tr", { "data-replica": id, "data-state": "unknown", "data-quorum": "in", class: "unreported" },
        el("td", {}, id),
        el("td", { class: "state muted" }, "no telemetry"),
        el("td", { class: "quorum quorum-in" }, "member"),
        el("td", {}, "–"), el("td", { class: "step" }, "–"), el("td", {}, "–"),
        el("td", {}, "–"), el("td", {}, "–"),
      ),
    );
  }
  body.replaceChildren(...rows);
  document.getElementById("replica-count").textContent = "(" + data.replicas.length + ")";
  const nodes = data.nodes.map((n) => n.node + " (" + n.ranks + " ranks, " + ago(data.now, n.last_seen) + ")");
  document.getElementById("nodes").textContent = nodes.length ? "nodes: " + nodes.join("; ") : "";
}

// ---- incidents -----------------------------------------------------------------------------

function who(i) {
  return i.replica_id + (i.rank === null ? "" : "/" + i.rank) + (i.host ? " on " + i.host : "");
}

function incidentKey(i) {
  return [i.detected_at, i.kind, i.replica_id, i.rank, i.summary].join("|");
}

function renderIncidents(data) {
  const list = document.getElementById("incidents");
  const existing = new Map([...list.children].map((node) => [node.dataset.key, node]));
  const items = data.incidents.map((i) => {
    const key = incidentKey(i);
    // Incidents never change: keep the node, so an opened disclosure stays open.
    return existing.get(key) || el(
      "li",
      { class: "kind-" + i.kind, "data-kind": i.kind, "data-replica": i.replica_id, "data-key": key },
      el("span", { class: "when" }, clock(i.detected_at)),
      el("span", { class: "kind" }, i.kind),
      el("span", { class: "who" }, who(i)),
      el("div", { class: "summary" }, i.summary),
      evidenceNode(i),
    );
  });
  list.replaceChildren(...items);
  document.getElementById("incident-count").textContent = "(" + items.length + ")";
  for (const i of data.incidents) {
    view.markers.set(incidentKey(i), { t: i.detected_at, kind: i.kind, replica_id: i.replica_id });
  }
}

// ---- quorum history, collapsed -------------------------------------------------------------

function foldQuorums(data) {
  view.quorumConfigured = data.configured;
  const fresh = data.quorums.filter((q) => q.round > view.lastRound);
  if (data.quorums.length && data.quorums[data.quorums.length - 1].round < view.lastRound) {
    // The quorum service started over (its rounds count from 1 again): so does the history.
    view.groups = [];
    view.quorums = [];
    view.lastRound = 0;
    return foldQuorums(data);
  }
  for (const q of fresh) {
    const members = q.members.slice().sort();
    const key = members.join("\u0000");
    const last = view.groups[view.groups.length - 1];
    if (last && last.key === key) {
      last.lastAt = q.formed_at;
      last.lastId = q.quorum_id;
      last.count += 1;
      last.healthy = q.healthy;
      last.maxStep = q.max_step;
    } else {
      view.groups.push({
        key, members, count: 1, firstAt: q.formed_at, lastAt: q.formed_at,
        firstId: q.quorum_id, lastId: q.quorum_id, healthy: q.healthy, maxStep: q.max_step,
        reason: q.reason, partial: view.lastRound === 0 && data.quorums.length >= QUORUM_HISTORY,
      });
    }
    view.quorums.push({ t: q.formed_at, members: q.members, healthy: q.healthy });
    view.lastRound = q.round;
  }
  trimTo(view.groups, MAX_QUORUM_GROUPS);
}

function renderQuorums(data) {
  const body = document.querySelector("#quorums tbody");
  if (!data.configured) {
    const none = el("td", { colspan: "8", class: "muted" }, "no quorum service configured");
    body.replaceChildren(el("tr", {}, none));
    document.getElementById("quorum-id").textContent = "";
    return;
  }
  const rows = view.groups
    .slice()
    .reverse()
    .map((g) =>
      el(
        "tr",
        { "data-members": g.members.join(","), "data-count": g.count },
        el("td", {}, g.firstId === g.lastId ? g.firstId : g.firstId + "–" + g.lastId),
        el("td", {}, (g.partial ? "≤ " : "") + clock(g.firstAt)),
        el("td", {}, clock(g.lastAt)),
        el("td", { class: "count" }, (g.partial ? "≥ " : "") + g.count),
        el("td", {}, g.members.join(", ")),
        el("td", {}, g.healthy.join(", ")),
        el("td", {}, g.maxStep),
        el("td", {}, g.reason),
      ),
    );
  body.replaceChildren(...rows);
  document.getElementById("quorum-id").textContent = "(current " + data.quorum_id + ")";
}

// ---- chart data, bounded -------------------------------------------------------------------

function foldSteps(records) {
  for (const r of records) {
    const id = r.rank.replica_id;
    let series = view.steps.get(id);
    if (!series) view.steps.set(id, (series = new Map()));
    const point = series.get(r.step);
    // A replica's step lasts as long as its slowest rank. A retried step (another attempt,
    // started after the first one ended) replaces the earlier attempt, whose records, read
    // again on every poll, are then ignored.
    if (!point || r.started_at > point.t + point.d) {
      series.set(r.step, { t: r.started_at, d: r.duration_s });
    } else if (r.started_at + r.duration_s >= point.t) {
      point.t = Math.min(point.t, r.started_at);
      point.d = Math.max(point.d, r.duration_s);
    }
  }
}

function prune(now) {
  const cutoff = now - WINDOW_S;
  for (const [id, series] of view.steps) {
    for (const [step, point] of series) if (point.t < cutoff) series.delete(step);
    if (series.size > MAX_POINTS) {
      const oldest = [...series].sort((x, y) => x[1].t - y[1].t).slice(0, series.size - MAX_POINTS);
      for (const [step] of oldest) series.delete(step);
    }
    if (!series.size) view.steps.delete(id);
  }
  view.samples = view.samples.filter((s) => s.t >= cutoff);
  trimTo(view.samples, MAX_POINTS);
  // Keep the quorum in force at the cutoff: it holds until the next one formed.
  const firstInside = view.quorums.findIndex((q) => q.t >= cutoff);
  if (firstInside > 1) view.quorums.splice(0, firstInside - 1);
  else if (firstInside === -1 && view.quorums.length > 1) view.quorums.splice(0, view.quorums.length - 1);
  trimTo(view.quorums, MAX_POINTS);
  for (const [key, marker] of view.markers) if (marker.t < cutoff) view.markers.delete(key);
  while (view.markers.size > MAX_MARKERS) view.markers.delete(view.markers.keys().next().value);
}

function xRange() {
  const now = view.now;
  let oldest = now - MIN_SPAN_S;
  for (const series of view.steps.values()) for (const p of series.values()) oldest = Math.min(oldest, p.t);
  for (const s of view.samples) oldest = Math.min(oldest, s.t);
  return [Math.max(oldest, now - WINDOW_S), now];
}

// uPlot wants one shared, sorted x array and one y array per series (null where it has none).
function aligned(columns) {
  const xs = [...new Set(columns.flatMap((c) => c.map((p) => p[0])))].sort((a, b) => a - b);
  const index = new Map(xs.map((x, i) => [x, i]));
  const data = [xs];
  for (const c of columns) {
    const ys = new Array(xs.length).fill(null);
    for (const [x, y] of c) ys[index.get(x)] = y;
    data.push(ys);
  }
  return data;
}

function stepData() {
  const ids = [...view.steps.keys()].sort();
  const columns = ids.map((id) =>
    [...view.steps.get(id).values()].sort((a, b) => a.t - b.t).map((p) => [p.t, p.d]),
  );
  return { names: ids, data: aligned(columns) };
}

function healthData(range) {
  const names = [];
  const columns = [];
  const samples = view.samples.map((s) => [s.t, s.healthy]);
  if (view.quorumConfigured) {
    // The quorum in force at the window's start, then each one formed, held until now.
    const inForce = view.quorums.map((q) => [Math.max(q.t, range[0]), q]);
    const members = inForce.map(([t, q]) => [t, q.members.length]);
    const healthy = inForce.map(([t, q]) => [t, q.healthy.length]);
    if (inForce.length) {
      const last = inForce[inForce.length - 1][1];
      members.push([range[1], last.members.length]);
      healthy.push([range[1], last.healthy.length]);
    }
    names.push("quorum members", "quorum healthy");
    columns.push(members, healthy);
  }
  names.push("healthy (health service)");
  columns.push(samples);
  return { names, data: aligned(columns) };
}

// ---- charts ----------------------------------------------------------------------------------

// Incidents as dashed vertical lines in their kind's colour; `onDrawn(count)` after each draw
// (uPlot draws in a microtask after setData, so the count is only known here).
function markerPlugin(onDrawn) {
  return {
    hooks: {
      draw: [
        (u) => {
          const { left, top, width, height } = u.bbox;
          const ctx = u.ctx;
          let drawn = 0;
          ctx.save();
          ctx.lineWidth = 2 * devicePixelRatio;
          ctx.setLineDash([6 * devicePixelRatio, 4 * devicePixelRatio]);
          for (const marker of view.markers.values()) {
            const x = Math.round(u.valToPos(marker.t, "x", true));
            if (x < left || x > left + width) continue;
            ctx.strokeStyle = kindColour(marker.kind);
            ctx.beginPath();
            ctx.moveTo(x, top);
            ctx.lineTo(x, top + height);
            ctx.stroke();
            drawn += 1;
          }
          ctx.restore();
          onDrawn(drawn);
        },
      ],
    },
  };
}

function chartSize(container) {
  return { width: Math.max(300, container.clientWidth), height: 220 };
}

function makeChart(container, names, data, options) {
  // A count holds until the next change: drawn as steps, not as slopes.
  const stepped = options.stepped ? uPlot.paths.stepped({ align: 1 }) : undefined;
  const series = [{}].concat(
    names.map((name, i) => ({
      label: name,
      stroke: options.colours[i],
      width: 2,
      spanGaps: true,
      paths: stepped,
      points: { show: !options.stepped },
      value: (u, v) => (v === null || v === undefined ? "–" : options.format(v)),
    })),
  );
  const opts = {
    ...chartSize(container),
    cursor: { sync: { key: "fthsdp" } },
    scales: { x: { time: true, range: () => xRange() }, y: options.y },
    axes: [{}, { label: options.label, size: 60 }],
    series,
    plugins: options.onMarkers ? [markerPlugin(options.onMarkers)] : [],
  };
  return new uPlot(opts, data, container);
}

function sameNames(chart, names) {
  if (!chart || chart.series.length !== names.length + 1) return false;
  return names.every((n, i) => chart.series[i + 1].label === n);
}

function renderCharts() {
  const range = xRange();
  const steps = stepData();
  const stepBox = document.getElementById("step-chart");
  document.getElementById("step-chart-empty").hidden = steps.names.length > 0;
  if (!sameNames(view.charts.steps, steps.names)) {
    if (view.charts.steps) view.charts.steps.destroy();
    view.charts.steps = steps.names.length
      ? makeChart(stepBox, steps.names, steps.data, {
          colours: steps.names.map(colourOf),
          label: "step time (s)",
          format: (v) => number(v) + " s",
          y: { range: (u, min, max) => [0, Math.max(max * 1.1, 0.001)] },
          onMarkers: () => {},
        })
      : null;
  } else {
    view.charts.steps.setData(steps.data);
  }
  const health = healthData(range);
  const healthBox = document.getElementById("health-chart");
  const colours = {
    "quorum members": "#57606a",
    "quorum healthy": "#1a7f37",
    "healthy (health service)": "#0969da",
  };
  if (!sameNames(view.charts.health, health.names)) {
    if (view.charts.health) view.charts.health.destroy();
    view.charts.health = makeChart(healthBox, health.names, health.data, {
      colours: health.names.map((n) => colours[n]),
      label: "replicas",
      format: (v) => String(v),
      y: { range: (u, min, max) => [0, Math.max(max + 1, 2)] },
      onMarkers: (count) => {
        view.markersDrawn = count;
      },
      stepped: true,
    });
  } else {
    view.charts.health.setData(health.data);
  }
}

function renderLegend() {
  const legend = document.getElementById("marker-legend");
  if (legend.children.length) return;
  legend.replaceChildren(
    ...KINDS.map((kind) => el("li", { class: "kind-" + kind }, el("span", { class: "swatch" }), kind)),
  );
}

// ---- the loop --------------------------------------------------------------------------------

async function poll() {
  const status = document.getElementById("status");
  try {
    const [replicas, incidents, quorums, steps] = await Promise.all([
      api("/v1/replicas"),
      api("/v1/incidents?limit=50"),
      api("/v1/quorum/history?limit=" + QUORUM_HISTORY).catch((error) => ({ configured: true, error })),
      api("/v1/records/steps?limit=" + STEP_RECORDS),
    ]);
    view.now = replicas.now;
    if (quorums.error) {
      document.getElementById("quorum-id").textContent = "(unavailable: " + quorums.error.message + ")";
    } else {
      foldQuorums(quorums);
      renderQuorums(quorums);
    }
    renderReplicas(replicas);
    renderIncidents(incidents);
    foldSteps(steps.records);
    view.samples.push({
      t: replicas.now,
      healthy: replicas.replicas.filter((r) => r.state === "healthy").length,
    });
    prune(replicas.now);
    renderCharts();
    view.polls += 1;
    status.textContent = "updated " + new Date().toLocaleTimeString();
    status.className = "status";
  } catch (err) {
    status.textContent = token ? "error: " + err.message : "no token: open this page as /dashboard#token=...";
    status.className = "status error";
    if (token) console.error(err);
  } finally {
    window.setTimeout(poll, POLL_MS);
  }
}

function resize() {
  for (const [id, chart] of [["step-chart", view.charts.steps], ["health-chart", view.charts.health]]) {
    if (chart) chart.setSize(chartSize(document.getElementById(id)));
  }
}

for (const node of document.querySelectorAll(".window")) node.textContent = WINDOW_S / 60 + " min";
renderLegend();
window.addEventListener("resize", resize);
poll();
