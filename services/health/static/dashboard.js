// fthsdp health dashboard: polls the health API every second and renders replicas, incidents
// and the quorum history. The bearer token comes from the URL fragment (#token=...), which the
// browser never sends to a server; it is presented as an Authorization header on every call.
// Every value from the API is inserted as text (textContent), never as HTML.
"use strict";

const POLL_MS = 1000;
const token = new URLSearchParams(window.location.hash.slice(1)).get("token") || "";

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

function renderReplicas(data) {
  const body = document.querySelector("#replicas tbody");
  const rows = data.replicas.map((r) =>
    el(
      "tr",
      { "data-replica": r.replica_id, "data-state": r.state },
      el("td", {}, r.replica_id),
      el("td", { class: "state state-" + r.state }, r.state),
      el("td", { class: "step" }, r.last_step),
      el("td", {}, r.ranks),
      el("td", {}, (r.hosts || []).join(", ")),
      el("td", {}, ago(data.now, r.last_seen)),
    ),
  );
  body.replaceChildren(...rows);
  document.getElementById("replica-count").textContent = "(" + rows.length + ")";
  const nodes = data.nodes.map((n) => n.node + " (" + n.ranks + " ranks, " + ago(data.now, n.last_seen) + ")");
  document.getElementById("nodes").textContent = nodes.length ? "nodes: " + nodes.join("; ") : "";
}

function renderIncidents(data) {
  const items = data.incidents.map((i) =>
    el(
      "li",
      { class: "kind-" + i.kind, "data-kind": i.kind, "data-replica": i.replica_id },
      el("span", { class: "when" }, clock(i.detected_at)),
      el("span", { class: "kind" }, i.kind),
      el("span", { class: "summary" }, i.summary),
      el("div", { class: "evidence" }, JSON.stringify(i.evidence)),
    ),
  );
  document.getElementById("incidents").replaceChildren(...items);
  document.getElementById("incident-count").textContent = "(" + items.length + ")";
}

function renderQuorums(data) {
  const body = document.querySelector("#quorums tbody");
  if (!data.configured) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: "6", class: "muted" }, "no quorum service configured")));
    return;
  }
  const rows = data.quorums
    .slice()
    .reverse()
    .map((q) =>
      el(
        "tr",
        { "data-quorum": q.quorum_id },
        el("td", {}, q.quorum_id),
        el("td", {}, clock(q.formed_at)),
        el("td", {}, q.members.join(", ")),
        el("td", {}, q.healthy.join(", ")),
        el("td", {}, q.max_step),
        el("td", {}, q.reason),
      ),
    );
  body.replaceChildren(...rows);
  document.getElementById("quorum-id").textContent = "(current " + data.quorum_id + ")";
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const [replicas, incidents, quorums] = await Promise.all([
      api("/v1/replicas"),
      api("/v1/incidents?limit=50"),
      api("/v1/quorum/history?limit=20").catch((err) => ({ configured: true, error: err, quorums: [] })),
    ]);
    renderReplicas(replicas);
    renderIncidents(incidents);
    if (quorums.error) {
      document.getElementById("quorum-id").textContent = "(unavailable: " + quorums.error.message + ")";
    } else {
      renderQuorums(quorums);
    }
    status.textContent = "updated " + new Date().toLocaleTimeString();
    status.className = "status";
  } catch (err) {
    status.textContent = token ? "error: " + err.message : "no token: open this page as /dashboard#token=...";
    status.className = "status error";
  } finally {
    window.setTimeout(poll, POLL_MS);
  }
}

poll();
