// Tool call graph browser (Cytoscape.js). The graph is loaded a few levels at a time: the page embeds
// the top levels, expanding a node fetches its subtree, search reveals a deep node's path. A node is
// shown when its parent is shown and not collapsed, so state survives collapse/expand.
// A TCG is a tree, so it is laid out by a tidy tree layout (depth left to right, leaves in rows, a
// parent centred on its children): linear time, where dagre's general DAG layout took most of the
// first paint.
(function () {
  "use strict";
  const TV = window.TV;
  const el = document.getElementById("cy");
  if (!el) return;
  performance.mark("tvcache-graph-start");
  const ds = el.dataset;
  const LEVELS = +ds.levels || 3;
  const STAFF = ds.staff === "1";
  const ROOT = "root";
  const store = new Map();   // id -> node data from the server
  const kids = new Map();    // parent id (ROOT for the top) -> Set of loaded child ids
  const collapsed = new Set();
  const loading = new Set();
  let topLevel = 0;
  let selected = null;
  let painted = false;

  // --- data -----------------------------------------------------------------------------------
  const parentOf = (d) => (d.parent == null ? ROOT : String(d.parent));

  function absorb(nodes) {
    for (const d of nodes) {
      const id = String(d.id);
      store.set(id, d);
      const p = parentOf(d);
      if (!kids.has(p)) kids.set(p, new Set());
      kids.get(p).add(id);
    }
  }

  function forget(id) {
    for (const child of kids.get(id) || []) forget(child);
    kids.delete(id);
    const d = store.get(id);
    if (d) {
      const siblings = kids.get(parentOf(d));
      if (siblings) siblings.delete(id);
      const parent = store.get(parentOf(d));
      if (parent) parent.children = Math.max(0, parent.children - 1);
      else if (parentOf(d) === ROOT) topLevel = Math.max(0, topLevel - 1);
    }
    store.delete(id);
    collapsed.delete(id);
  }

  const childCount = (id) => (id === ROOT ? topLevel : (store.get(id) || {}).children || 0);
  const loadedCount = (id) => (kids.get(id) || new Set()).size;

  function visibleIds() {
    const out = [ROOT];
    for (let i = 0; i < out.length; i++) {
      const id = out[i];
      if (collapsed.has(id)) continue;
      for (const child of kids.get(id) || []) out.push(child);
    }
    return out;
  }

  // --- looks ----------------------------------------------------------------------------------
  const RAMP = [[229, 231, 235], [134, 239, 172], [21, 128, 61]]; // no hits -> some -> 1000+
  function hitColor(hits) {
    const t = Math.min(1, Math.log10(1 + hits) / 3);
    const [a, b, u] = t < 0.5 ? [RAMP[0], RAMP[1], t * 2] : [RAMP[1], RAMP[2], (t - 0.5) * 2];
    return "rgb(" + a.map((x, i) => Math.round(x + (b[i] - x) * u)).join(",") + ")";
  }
  const sizeFor = (ms) => Math.round(12 + 6 * Math.log10(1 + (ms || 0)));  // 1 ms: 14 px, 10 s: 36 px

  function label(id) {
    const hidden = collapsed.has(id) ? childCount(id) : childCount(id) - loadedCount(id);
    const base = id === ROOT ? "task root" : store.get(id).label;
    return hidden > 0 ? base + "  +" + hidden : base;
  }

  function elementData(id) {
    if (id === ROOT) return { id, label: label(id), fill: "#111827", size: 20, root: 1 };
    const d = store.get(id);
    return {
      id, label: label(id), fill: hitColor(d.hits), size: sizeFor(d.exec_ms), hits: d.hits,
      mutates: d.mutates ? 1 : 0, snapshot: d.snapshot ? 1 : 0, pinned: d.pinned ? 1 : 0,
      more: childCount(id) > loadedCount(id) || (collapsed.has(id) && childCount(id) > 0) ? 1 : 0,
    };
  }

  const style = [
    { selector: "node", style: {
      "background-color": "data(fill)", width: "data(size)", height: "data(size)", label: "data(label)",
      "font-size": 10, color: "#1f2937", "text-valign": "bottom", "text-halign": "center", "text-margin-y": 3,
      "text-wrap": "ellipsis", "text-max-width": 150,
      "border-width": 1, "border-color": "#9ca3af", shape: "ellipse", "border-style": "dashed",
      "min-zoomed-font-size": 6 } },
    { selector: "node[mutates = 1]", style: { shape: "round-rectangle", "border-style": "solid" } },
    { selector: "node[more = 1]", style: { "border-style": "dotted", "border-color": "#6b7280", "border-width": 2 } },
    { selector: "node[snapshot = 1]", style: { "border-color": "#2563eb", "border-width": 3, "border-style": "solid" } },
    { selector: "node[pinned = 1]", style: { "outline-color": "#a16207", "outline-width": 3, "outline-offset": 2 } },
    { selector: "node[root = 1]", style: { shape: "diamond", color: "#111827", "font-weight": "bold", "border-width": 0 } },
    { selector: "node.match", style: { "underlay-color": "#f59e0b", "underlay-padding": 6, "underlay-opacity": 0.45 } },
    { selector: "node.fresh", style: { "underlay-color": "#facc15", "underlay-padding": 8, "underlay-opacity": 0.7 } },
    { selector: "node:selected", style: { "underlay-color": "#2563eb", "underlay-padding": 7, "underlay-opacity": 0.35 } },
    { selector: "edge", style: { width: 1.2, "line-color": "#cbd5e1", "curve-style": "taxi", "taxi-direction": "rightward",
      "target-arrow-shape": "none" } },
  ];

  const cy = cytoscape({ container: el, style, wheelSensitivity: 0.3, minZoom: 0.05, maxZoom: 3,
                         boxSelectionEnabled: false, selectionType: "single" });
  performance.mark("tvcache-graph-cy");

  // --- keep the canvas in step with the data ----------------------------------------------------
  function sync(focus) {
    const want = visibleIds();
    const wanted = new Set(want);
    cy.batch(() => {
      cy.nodes().forEach((n) => { if (!wanted.has(n.id())) cy.remove(n); });
      const add = [];
      for (const id of want) {
        const node = cy.getElementById(id);
        if (node.nonempty()) { node.data(elementData(id)); continue; }
        add.push({ group: "nodes", data: elementData(id) });
        if (id !== ROOT) add.push({ group: "edges", data: { id: "e" + id, source: parentOf(store.get(id)), target: id } });
      }
      cy.add(add);
    });
    if (!painted) performance.mark("tvcache-graph-added");
    const positions = treeLayout();
    cy.layout({ name: "preset", positions: (node) => positions[node.id()], animate: false, fit: false }).run();
    if (!painted) performance.mark("tvcache-graph-layout");
    if (!painted || focus !== undefined) frame(focus);
    if (!painted) {
      painted = true;
      cy.one("render", () => {
        performance.mark("tvcache-graph-first-paint");
        window.tvGraphFirstPaint = performance.now();
        el.dataset.painted = "1";
      });
      cy.forceRender && cy.forceRender();
    }
    document.getElementById("graph-count").textContent =
      (want.length - 1) + " shown of " + document.getElementById("live-nodes").textContent + " nodes";
  }
  const syncSoon = TV.debounce(() => sync(), 500);

  const COLUMN = 190, ROW = 46;  // px: a label is at most 150 wide, a node at most ~40 tall plus its label
  function shownChildren(id) {
    if (collapsed.has(id)) return [];
    return [...(kids.get(id) || [])].sort((a, b) => a - b);
  }
  function treeLayout() {
    const positions = {};
    let row = 0;
    const place = (id, column) => {
      const children = shownChildren(id);
      let y;
      if (!children.length) y = row++ * ROW;
      else {
        const ys = children.map((child) => place(child, column + 1));
        y = (ys[0] + ys[ys.length - 1]) / 2;
      }
      positions[id] = { x: column * COLUMN, y };
      return y;
    };
    place(ROOT, 0);
    return positions;
  }

  // The whole graph when it fits at a readable zoom; else a readable zoom around the node acted on
  // (or the root, at the left edge), and the user pans from there.
  const READABLE = 0.6;
  function fitView() {
    cy.fit(undefined, 30);
    if (cy.zoom() > 1.2) { cy.zoom(1.2); cy.center(); }
  }
  function frame(focus) {
    fitView();
    if (cy.zoom() >= READABLE) return;
    cy.zoom(0.9);
    const node = cy.getElementById(focus || ROOT);
    if (focus && node.nonempty()) { cy.center(node); return; }
    const at = node.renderedPosition();
    cy.panBy({ x: 40 - at.x, y: el.clientHeight / 2 - at.y });
  }

  async function getJSON(url) {
    const response = await fetch(url, { credentials: "same-origin" });
    if (!response.ok) throw new Error(url + ": " + response.status);
    return response.json();
  }

  async function expand(id) {
    collapsed.delete(id);
    if (loadedCount(id) < childCount(id) && !loading.has(id) && id !== ROOT) {
      loading.add(id);
      try {
        const slice = await getJSON(ds.api + "?root=" + encodeURIComponent(id) + "&depth=" + LEVELS);
        absorb(slice.nodes.filter((d) => String(d.id) !== id));
      } finally { loading.delete(id); }
    }
    sync(id);
    showPanel(id);
  }

  function collapse(id) {
    if (id === ROOT || childCount(id) === 0) return;
    collapsed.add(id);
    sync(id);
    showPanel(id);
  }

  const isOpen = (id) => !collapsed.has(id) && loadedCount(id) > 0;

  // --- side panel -------------------------------------------------------------------------------
  function esc(text) { const d = document.createElement("div"); d.textContent = text; return d.innerHTML; }

  function control(id, action, title) {
    const next = encodeURIComponent(location.pathname);
    return '<a class="btn small" data-control="' + action + '" href="/tasks/' + encodeURIComponent(ds.task) + "/nodes/" + id +
      "/" + action + "/?next=" + next + '">' + title + "</a>";
  }

  function showPanel(id) {
    selected = id;
    const panel = document.getElementById("node-panel");
    document.getElementById("btn-expand").disabled = !id || !(childCount(id) > loadedCount(id) || collapsed.has(id));
    document.getElementById("btn-collapse").disabled = !id || id === ROOT || !isOpen(id);
    if (!id || id === ROOT) {
      panel.innerHTML = "<h3>Task root</h3><p class='muted'>The task's fresh sandbox. " + topLevel + " call(s) start here.</p>";
      return;
    }
    const d = store.get(id);
    if (!d) return;
    const facts = [
      ["tool", esc(d.tool) + (d.mutates ? " · changes state" : " · read-only")],
      ["exec", TV.fmt.duration(d.exec_ms)], ["hits", d.hits], ["depth", d.depth],
      ["children", d.children + (d.children > loadedCount(id) ? " (" + loadedCount(id) + " loaded)" : "")],
      ["snapshot", d.snapshot ? '<span class="badge live">live</span>' : "none"],
      ["pinned", d.pinned ? '<span class="badge pinned">pinned</span>' : "no"],
    ];
    let html = "<h3 class='mono'>#" + d.id + " " + esc(d.label) + "</h3><div class='text mono'>" + esc(d.text) + "</div>" +
      "<dl class='facts' style='margin-top:8px'>" + facts.map((f) => "<dt>" + f[0] + "</dt><dd>" + f[1] + "</dd>").join("") + "</dl>" +
      "<div class='actions'><a class='btn small' id='open-node' href='" + ds.nodeUrl + d.id + "/'>Open details</a></div>";
    if (STAFF) {
      html += "<div class='actions'>" + control(d.id, "evict-subtree", "Evict subtree…") +
        (d.snapshot ? control(d.id, "evict-snapshot", "Evict snapshot…") : "") +
        (d.pinned ? control(d.id, "unpin", "Unpin…") : control(d.id, "pin", "Pin…")) + "</div>";
    }
    panel.innerHTML = html;
  }

  cy.on("tap", "node", (evt) => showPanel(evt.target.id()));
  cy.on("tap", (evt) => { if (evt.target === cy) { cy.$(":selected").unselect(); showPanel(null); } });
  cy.on("dbltap", "node", (evt) => { const id = evt.target.id(); isOpen(id) ? collapse(id) : expand(id); });
  document.getElementById("btn-expand").addEventListener("click", () => selected && expand(selected));
  document.getElementById("btn-collapse").addEventListener("click", () => selected && collapse(selected));
  document.getElementById("btn-fit").addEventListener("click", fitView);
  document.getElementById("btn-reset").addEventListener("click", () => reset());

  // --- search: highlight loaded matches, list server matches, reveal one on click -----------------
  const searchBox = document.getElementById("graph-search");
  const runSearch = TV.debounce(async () => {
    const q = searchBox.value.trim();
    const panel = document.getElementById("search-panel"), list = document.getElementById("search-results");
    cy.nodes().removeClass("match");
    if (!q) { panel.hidden = true; return; }
    const lower = q.toLowerCase();
    cy.nodes().filter((n) => n.id() !== ROOT && store.get(n.id()).text.toLowerCase().includes(lower)).addClass("match");
    const found = await getJSON(ds.searchApi + "?q=" + encodeURIComponent(q));
    panel.hidden = false;
    document.getElementById("search-count").textContent = found.nodes.length + (found.nodes.length >= 30 ? "+" : "");
    list.innerHTML = found.nodes.map((d) => "<li data-id='" + d.id + "' class='mono'>#" + d.id + " " + esc(d.label) + "</li>").join("");
  }, 300);
  searchBox.addEventListener("input", runSearch);
  document.getElementById("search-results").addEventListener("click", (evt) => {
    const li = evt.target.closest("li[data-id]");
    if (li) reveal(li.dataset.id);
  });

  async function reveal(id) {
    const data = await getJSON(ds.revealApi + encodeURIComponent(id));
    absorb(data.nodes);
    for (const step of data.path) collapsed.delete(String(step));
    collapsed.delete(ROOT);
    sync(id);
    cy.$(":selected").unselect();
    cy.getElementById(id).select();
    showPanel(id);
  }

  // --- live updates ------------------------------------------------------------------------------
  const pendingNew = new Set();
  const fetchNew = TV.debounce(async () => {
    const ids = [...pendingNew].slice(0, 400);
    ids.forEach((id) => pendingNew.delete(id));
    if (!ids.length) return;
    const data = await getJSON(ds.nodesApi + "?ids=" + ids.join(","));
    const fresh = data.nodes.filter((d) => !store.has(String(d.id)));
    for (const d of fresh) {
      const p = parentOf(d);
      if (p === ROOT) topLevel += 1;
      else if (store.has(p)) store.get(p).children += 1;
    }
    // Only nodes whose parent is already loaded are placed; the rest show up as "+N" or on expansion.
    absorb(fresh.filter((d) => parentOf(d) === ROOT || store.has(parentOf(d))));
    sync();
    for (const d of fresh) {
      const node = cy.getElementById(String(d.id));
      node.addClass("fresh");
      setTimeout(() => node.removeClass("fresh"), 3000);
    }
  }, 400);

  function counter(id, delta) {
    const cell = document.getElementById(id);
    if (!delta || !cell) return;
    cell.textContent = +cell.textContent + delta;
    TV.flash(cell);
  }

  TV.onLive((m) => {
    if (m.type !== "task") return;
    counter("live-calls", m.lookups);
    counter("live-hits", m.hits);
    counter("live-nodes", m.nodes);
    let restyle = false;
    for (const [id, n] of Object.entries(m.node_hits || {})) {
      const d = store.get(id);
      if (d) { d.hits += n; restyle = true; }
    }
    for (const event of m.events || []) {
      if (event.kind === "node_created") { pendingNew.add(String(event.node_id)); fetchNew(); }
      else if (event.kind === "nodes_removed") { event.node_ids.map(String).forEach((id) => store.has(id) && forget(id)); restyle = true; }
      else if (event.kind === "snapshot" && store.has(String(event.node_id))) { store.get(String(event.node_id)).snapshot = event.event === "created"; restyle = true; }
      else if (event.kind === "node_changed" && store.has(String(event.node_id))) { Object.assign(store.get(String(event.node_id)), event); restyle = true; }
      else if (event.kind === "task_changed") { reload(); return; }
    }
    if (m.overflow) reload();
    else if (restyle) syncSoon();
    if (selected && store.has(selected)) showPanel(selected);
  });

  // --- start ---------------------------------------------------------------------------------------
  function load(slice) {
    store.clear(); kids.clear(); collapsed.clear();
    topLevel = slice.top_level || 0;
    absorb(slice.nodes);
    sync();
    showPanel(null);
  }
  async function reload() { load(await getJSON(ds.api)); }
  async function reset() { await reload(); frame(null); }

  window.tvGraph = { cy, store, expand, collapse, reveal, isOpen, childCount, loadedCount, select: showPanel };
  load(JSON.parse(document.getElementById("graph-initial").textContent));
})();
