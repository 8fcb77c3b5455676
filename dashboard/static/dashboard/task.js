// Task page: the hit rate per epoch (uPlot) and live counters for the task and its tools.
(function () {
  "use strict";
  const TV = window.TV;
  const cards = document.getElementById("task-cards");
  if (!cards) return;
  const epochs = JSON.parse(document.getElementById("epochs-data").textContent); // [[epoch, calls, hits, oracle hits], ...]
  const chartEl = document.getElementById("epoch-chart");
  let chart = null;

  function series() {
    const rows = epochs.filter((e) => e[1] > 0);
    return [rows.map((e) => e[0]), rows.map((e) => (100 * e[2]) / e[1]), rows.map((e) => (100 * e[3]) / e[1])];
  }

  function drawChart() {
    const data = series();
    if (!data[0].length) { chartEl.innerHTML = '<p class="empty">No calls yet.</p>'; return; }
    if (chart) { chart.setData(data); return; }
    chartEl.innerHTML = "";
    chart = new uPlot({
      width: chartEl.clientWidth - 16, height: 240,
      scales: { x: { time: false }, y: { range: [0, 100] } },
      legend: { live: false },
      axes: [{ label: "epoch", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] },
             { label: "hit rate (%)", size: 50 }],
      series: [{ label: "epoch" },
               { label: "hit rate", stroke: "#16a34a", width: 2, points: { size: 6 }, value: (u, v) => (v == null ? "–" : v.toFixed(1) + " %") },
               { label: "oracle", stroke: "#9ca3af", dash: [6, 4], width: 1.5, value: (u, v) => (v == null ? "–" : v.toFixed(1) + " %") }],
    }, data, chartEl);
    window.addEventListener("resize", TV.debounce(() => chart.setSize({ width: chartEl.clientWidth - 16, height: 240 }), 200));
  }
  drawChart();

  function setText(id, text) {
    const el = document.getElementById(id);
    if (el && el.textContent !== String(text)) { el.textContent = text; TV.flash(el.parentElement); }
  }

  function showCards() {
    const d = cards.dataset, calls = +d.calls, hits = +d.hits;
    setText("live-calls", calls);
    setText("live-hits", hits);
    setText("live-rate", TV.fmt.percent(calls ? hits / calls : 0));
    setText("live-oracle", TV.fmt.percent(calls ? +d.oracle / calls : 0));
    setText("live-saved", TV.fmt.duration(+d.saved));
    setText("live-nodes", d.nodes);
    setText("live-snapshots", d.snapshots);
  }

  function bumpTools(perTool) {
    for (const [tool, [calls, hits, saved, oracle, stateHits, stateOracle]] of Object.entries(perTool || {})) {
      const tr = document.querySelector('#tool-table tr[data-tool="' + CSS.escape(tool) + '"]');
      if (!tr) continue; // a new tool appears on the next visit
      const d = tr.dataset;
      d.calls = +d.calls + calls; d.hits = +d.hits + hits; d.saved = +d.saved + saved; d.oracle = +d.oracle + oracle;
      d.stateHits = +d.stateHits + (stateHits || 0); d.stateOracle = +d.stateOracle + (stateOracle || 0);
      tr.querySelector(".c-state-hits").textContent = d.stateHits;
      tr.querySelector(".c-state-oracle").textContent = TV.fmt.percent(+d.calls ? +d.stateOracle / +d.calls : 0);
      tr.querySelector(".c-calls").textContent = d.calls;
      tr.querySelector(".c-rate").textContent = TV.fmt.percent(+d.calls ? +d.hits / +d.calls : 0);
      tr.querySelector(".c-oracle").textContent = TV.fmt.percent(+d.calls ? +d.oracle / +d.calls : 0);
      tr.querySelector(".c-saved").textContent = TV.fmt.duration(+d.saved);
      TV.flash(tr);
    }
  }

  TV.onLive((m) => {
    if (m.type !== "task") return;
    const d = cards.dataset;
    d.calls = +d.calls + m.lookups; d.hits = +d.hits + m.hits; d.saved = +d.saved + m.saved_ms; d.oracle = +d.oracle + m.oracle;
    d.nodes = +d.nodes + m.nodes; d.snapshots = Math.max(0, +d.snapshots + m.snapshots);
    showCards();
    bumpTools(m.per_tool);
    if (m.per_epoch && Object.keys(m.per_epoch).length) {
      for (const [key, [calls, hits, oracle]] of Object.entries(m.per_epoch)) {
        const epoch = +key;
        let row = epochs.find((e) => e[0] === epoch);
        if (!row) { row = [epoch, 0, 0, 0]; epochs.push(row); epochs.sort((a, b) => a[0] - b[0]); }
        row[1] += calls; row[2] += hits; row[3] += oracle;
      }
      drawChart();
    }
    if ((m.events || []).some((e) => e.kind === "task_changed")) {
      const notice = document.createElement("ul");
      notice.className = "messages";
      notice.innerHTML = '<li>This task changed (flushed or re-budgeted). <a href="">Reload</a> for fresh figures.</li>';
      if (!document.getElementById("changed-notice")) { notice.id = "changed-notice"; cards.before(notice); }
    }
  });
})();
