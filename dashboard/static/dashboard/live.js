// Live updates shared by every page: one websocket per page (its topic is <body data-live>), reconnecting
// with back-off. The server coalesces pushes (a few per second per page), so handlers can do DOM work.
// Also: number formatting, sparklines, and the overview, pools and node pages' live behaviour.
(function () {
  "use strict";
  const TV = (window.TV = window.TV || {});
  const handlers = [];
  TV.onLive = (fn) => handlers.push(fn);
  TV.received = 0;

  TV.fmt = {
    percent: (x) => (x == null || isNaN(x) ? "–" : (100 * x).toFixed(1) + " %"),
    duration: (ms) => {
      if (ms == null) return "–";
      if (ms < 1000) return ms >= 10 ? ms.toFixed(0) + " ms" : ms.toFixed(1) + " ms";
      let s = ms / 1000;
      if (s < 60) return s.toFixed(1) + " s";
      s = Math.floor(s);
      const m = Math.floor(s / 60);
      if (m < 60) return m + " min " + String(s % 60).padStart(2, "0") + " s";
      return Math.floor(m / 60) + " h " + String(m % 60).padStart(2, "0") + " min";
    },
  };

  TV.debounce = (fn, ms) => {
    let timer = null;
    return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
  };

  TV.flash = (el) => { if (!el) return; el.classList.remove("flash"); void el.offsetWidth; el.classList.add("flash"); };

  // Swap a server-rendered fragment into a container (its data-fragment URL).
  TV.refetch = async (container, after) => {
    const response = await fetch(container.dataset.fragment, { headers: { "X-Requested-With": "fetch" } });
    if (response.ok) { container.innerHTML = await response.text(); if (after) after(); }
  };

  // Hit rate per epoch as a small SVG line: epochs = [[epoch, calls, hits], ...].
  TV.sparkline = (svg, epochs) => {
    const NS = "http://www.w3.org/2000/svg";
    const w = +svg.getAttribute("width"), h = +svg.getAttribute("height"), pad = 3;
    svg.replaceChildren();
    const points = epochs.filter((e) => e[1] > 0).map((e) => [e[0], e[2] / e[1]]);
    if (!points.length) {
      const t = document.createElementNS(NS, "text");
      t.setAttribute("x", 0); t.setAttribute("y", h - 9); t.setAttribute("fill", "#9ca3af"); t.setAttribute("font-size", "11");
      t.textContent = "no calls yet"; svg.appendChild(t); return;
    }
    const base = document.createElementNS(NS, "line");
    base.setAttribute("x1", pad); base.setAttribute("x2", w - pad); base.setAttribute("y1", h - pad); base.setAttribute("y2", h - pad);
    base.setAttribute("stroke", "#e5e7eb"); svg.appendChild(base);
    const n = points.length;
    const xy = points.map((p, i) => [pad + (n === 1 ? (w - 2 * pad) : (i * (w - 2 * pad)) / (n - 1)), h - pad - p[1] * (h - 2 * pad)]);
    if (n === 1) xy.unshift([pad, xy[0][1]]);
    const line = document.createElementNS(NS, "polyline");
    line.setAttribute("points", xy.map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", "#16a34a"); line.setAttribute("stroke-width", "1.6");
    svg.appendChild(line);
    const last = xy[xy.length - 1], dot = document.createElementNS(NS, "circle");
    dot.setAttribute("cx", last[0]); dot.setAttribute("cy", last[1]); dot.setAttribute("r", "2.5"); dot.setAttribute("fill", "#15803d");
    svg.appendChild(dot);
    const title = document.createElementNS(NS, "title");
    title.textContent = points.map((p) => "epoch " + p[0] + ": " + TV.fmt.percent(p[1])).join("\n");
    svg.appendChild(title);
  };

  // Add per-epoch deltas {epoch: [lookups, hits]} into [[epoch, calls, hits], ...] (kept sorted).
  TV.mergeEpochs = (epochs, perEpoch) => {
    for (const [key, [calls, hits]] of Object.entries(perEpoch || {})) {
      const epoch = +key;
      let row = epochs.find((e) => e[0] === epoch);
      if (!row) { row = [epoch, 0, 0]; epochs.push(row); epochs.sort((a, b) => a[0] - b[0]); }
      row[1] += calls; row[2] += hits;
    }
    return epochs;
  };

  // --- the websocket ------------------------------------------------------------------------
  function socketPath(topic) {
    if (topic.startsWith("task:")) return "tasks/" + encodeURIComponent(topic.slice(5)) + "/";
    return topic + "/";
  }

  function connect(topic, delay) {
    const status = document.getElementById("live-status");
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const ws = new WebSocket(scheme + location.host + "/ws/dashboard/" + socketPath(topic));
    ws.onopen = () => {
      delay = 1000;
      if (status) { status.textContent = "● live"; status.classList.add("on"); }
    };
    ws.onmessage = (event) => {
      TV.received += 1;
      const message = JSON.parse(event.data);
      for (const fn of handlers) {
        try { fn(message); } catch (err) { console.error(err); }
      }
    };
    ws.onclose = () => {
      if (status) { status.textContent = "○ offline"; status.classList.remove("on"); }
      setTimeout(() => connect(topic, Math.min(delay * 2, 15000)), delay);
    };
    TV.socket = ws;
  }

  // --- overview -----------------------------------------------------------------------------
  function overviewRow(tr) {
    const d = tr.dataset, calls = +d.calls, hits = +d.hits;
    tr.querySelector(".c-calls").textContent = calls;
    tr.querySelector(".c-rate").textContent = TV.fmt.percent(calls ? hits / calls : 0);
    tr.querySelector(".c-oracle").textContent = TV.fmt.percent(calls ? +d.oracle / calls : 0);
    tr.querySelector(".c-saved").textContent = TV.fmt.duration(+d.saved);
    tr.querySelector(".c-nodes").textContent = d.nodes;
    tr.querySelector(".c-snapshots").textContent = d.snapshots;
  }

  function drawSparks() {
    document.querySelectorAll("#overview-table tr[data-task]").forEach((tr) => {
      TV.sparkline(tr.querySelector("svg.spark"), JSON.parse(tr.dataset.epochs));
    });
  }

  function overviewPage() {
    const body = document.getElementById("overview-body");
    if (!body) return;
    drawSparks();
    const refetch = TV.debounce(() => TV.refetch(body, drawSparks), 400);
    TV.onLive((m) => {
      if (m.type !== "overview") return;
      if (m.changed && m.changed.length) refetch();
      for (const [taskId, t] of Object.entries(m.tasks)) {
        const tr = body.querySelector('tr[data-task="' + CSS.escape(taskId) + '"]');
        if (!tr) continue;  // on another page or filtered out; a new task comes as a change
        const d = tr.dataset;
        d.calls = +d.calls + t.lookups; d.hits = +d.hits + t.hits; d.oracle = +d.oracle + t.oracle; d.saved = +d.saved + t.saved_ms;
        d.nodes = +d.nodes + t.nodes; d.snapshots = Math.max(0, +d.snapshots + t.snapshots);
        const epochs = TV.mergeEpochs(JSON.parse(d.epochs), t.per_epoch);
        d.epochs = JSON.stringify(epochs);
        overviewRow(tr);
        TV.sparkline(tr.querySelector("svg.spark"), epochs);
        TV.flash(tr);
      }
    });
    setInterval(() => { if (!document.hidden) refetch(); }, 60000);  // sandboxes and new tasks are not pushed here
  }

  // --- pools: re-render the server fragment when anything changes ----------------------------
  function poolsPage() {
    const body = document.getElementById("pools-body");
    if (!body) return;
    const refetch = TV.debounce(() => TV.refetch(body), 300);
    TV.onLive((m) => { if (m.type === "pools") refetch(); });
  }

  // --- node page: its hit counter -------------------------------------------------------------
  function nodePage() {
    const facts = document.getElementById("node-facts");
    if (!facts) return;
    TV.onLive((m) => {
      const n = m.type === "task" && m.node_hits && m.node_hits[facts.dataset.node];
      if (!n) return;
      facts.dataset.hits = +facts.dataset.hits + n;
      const cell = document.getElementById("node-hits");
      cell.textContent = facts.dataset.hits;
      TV.flash(cell);
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    overviewPage();
    poolsPage();
    nodePage();
    const topic = document.body.dataset.live;
    if (topic) connect(topic, 1000);
    else if (document.getElementById("live-status")) document.getElementById("live-status").hidden = true;
  });
})();
