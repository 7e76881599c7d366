// The turn page: the timeline chart (Chart.js, vendored) and the steps table, live while the turn runs.
(function () {
  "use strict";
  const el = document.getElementById("timeline-data");
  if (!el) return;
  let tl = JSON.parse(el.textContent);
  const base = "/ui/conversations/" + encodeURIComponent(tl.conversationId) + "/turns/" + encodeURIComponent(tl.turnId);
  const MARKERS = [
    { kind: "trimmed", label: "outputs trimmed", style: "triangle", color: "#d04545" },
    { kind: "offloaded", label: "blobs offloaded", style: "rect", color: "#7a55d0" },
    { kind: "compaction-in-loop", label: "compaction (in-loop)", style: "star", color: "#1f77c9" },
    { kind: "compaction-turn-start", label: "compaction (turn start)", style: "star", color: "#1d8a4d" },
    { kind: "fit", label: "window fitted in-process", style: "rectRot", color: "#555" },
    { kind: "prefix-broke", label: "prefix broke", style: "crossRot", color: "#e07b00" },
  ];

  function has(row, kind) { return row.markers.some(function (m) { return m.kind === kind; }); }

  function datasets(t) {
    const rows = t.steps;
    const flat = function (v) { return rows.map(function () { return v; }); };
    const ds = [
      { label: "served tokens", data: rows.map(function (r) { return r.servedTokens; }), borderColor: "#2f5fd0",
        backgroundColor: "#2f5fd0", pointRadius: 3, tension: 0, order: 1 },
      { label: "raw history tokens", data: rows.map(function (r) { return r.rawTokens; }), borderColor: "#9aa3b2",
        backgroundColor: "#9aa3b2", borderDash: [6, 4], pointRadius: 2, tension: 0, order: 2 },
    ];
    if (t.cacheReported) {
      ds.push({ label: "cache-read tokens", data: rows.map(function (r) { return r.cacheReadTokens; }),
        borderColor: "#16a394", backgroundColor: "#16a394", pointRadius: 2, tension: 0, order: 3 });
    }
    if (t.window) {
      ds.push({ label: "window", data: flat(t.window), borderColor: "#b42318", borderWidth: 2, pointRadius: 0,
        pointHitRadius: 0, order: 4 });
    }
    if (t.trigger) {
      ds.push({ label: "compaction trigger", data: flat(t.trigger), borderColor: "#e0a100", borderWidth: 2,
        borderDash: [3, 3], pointRadius: 0, pointHitRadius: 0, order: 5 });
    }
    // markers sit on the served-tokens point, stacked upwards so that several on one step stay visible
    const top = Math.max.apply(null, rows.map(function (r) { return Math.max(r.servedTokens || 0, r.rawTokens || 0); })
      .concat([t.window || 0, 1]));
    const lift = top * 0.035;
    MARKERS.forEach(function (m, i) {
      if (!rows.some(function (r) { return has(r, m.kind); })) return;
      ds.push({ label: m.label, marker: m.kind, showLine: false, pointStyle: m.style, pointRadius: 8,
        pointHoverRadius: 10, borderColor: m.color, backgroundColor: m.color + "55", borderWidth: 2, order: 0,
        data: rows.map(function (r) {
          if (!has(r, m.kind)) return null;
          const below = MARKERS.slice(0, i).filter(function (o) { return has(r, o.kind); }).length;
          return r.servedTokens + below * lift;
        }) });
    });
    return ds;
  }

  const chart = new Chart(document.getElementById("chart"), {
    type: "line",
    data: { labels: tl.steps.map(function (r) { return String(r.step); }), datasets: datasets(tl) },
    options: {
      animation: false, maintainAspectRatio: false, spanGaps: false,
      interaction: { mode: "index", intersect: false },
      scales: { x: { title: { display: true, text: "step" } },
                y: { beginAtZero: true, title: { display: true, text: "tokens" } } },
      plugins: {
        tooltip: { callbacks: {
          footer: function (items) {
            const row = tl.steps[items[0].dataIndex];
            return row ? row.markers.map(function (m) { return "• " + m.label; }) : [];
          } } },
        legend: { position: "bottom", labels: { usePointStyle: true } },
      },
      onClick: function (_evt, elements) {
        if (elements.length) window.location = base + "/steps/" + tl.steps[elements[0].index].step;
      },
    },
  });
  window.inspectorChart = chart;

  function fmt(n) { return n === null || n === undefined ? "—" : Number(n).toLocaleString("en-US"); }
  function cell(tr, text, cls) { const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; tr.appendChild(td); return td; }

  function renderTable(t) {
    const body = document.querySelector("#steps tbody");
    body.textContent = "";
    t.steps.forEach(function (r) {
      const tr = document.createElement("tr");
      tr.dataset.step = r.step;
      const first = cell(tr, "", "num");
      const a = document.createElement("a");
      a.href = base + "/steps/" + r.step; a.textContent = String(r.step); a.className = "step-link";
      first.appendChild(a);
      cell(tr, r.tools.join(", ") || "—");
      cell(tr, fmt(r.servedTokens), "num");
      cell(tr, fmt(r.rawTokens), "num");
      cell(tr, fmt(r.inputTokens), "num");
      cell(tr, fmt(r.cacheReadTokens), "num");
      cell(tr, r.prefix ? (r.prefix.first ? "first" : (r.prefix.extends ? "kept " + r.prefix.kept : "broke at " + r.prefix.kept)) : "—");
      const mk = cell(tr, "");
      r.markers.forEach(function (m) {
        const b = document.createElement("span");
        b.className = "badge m-" + m.kind; b.textContent = m.kind; b.title = m.label;
        mk.appendChild(b);
      });
      body.appendChild(tr);
    });
    const status = document.getElementById("status");
    status.textContent = t.status; status.className = "badge status-" + t.status;
  }

  function update(t) {
    tl = t;
    chart.data.labels = t.steps.map(function (r) { return String(r.step); });
    chart.data.datasets = datasets(t);
    chart.update();
    renderTable(t);
  }

  renderTable(tl);
  if (tl.status === "completed" || tl.status === "failed") return;

  // live: the turn's events over SSE (the cookie authenticates EventSource); each one refreshes the timeline
  const live = document.getElementById("live");
  let pending = null, asked = 0, shown = 0;
  function refresh() {
    if (pending) return;
    pending = setTimeout(function () {
      pending = null;
      const seq = ++asked;
      fetch(base.replace("/ui/conversations/", "/ui/api/conversations/") + "/timeline", { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (t) { if (t && seq > shown) { shown = seq; update(t); } });
    }, 150);
  }
  const es = new EventSource(base.replace("/ui/conversations/", "/ui/api/conversations/") + "/events");
  live.textContent = "live: following the turn's events";
  ["StepServed", "ToolResultRecorded", "CompactionDecided", "InLoopFoldRecorded", "TurnStarted", "TurnResumed"].forEach(function (type) {
    es.addEventListener(type, refresh);
  });
  ["TurnCompleted", "TurnFailed"].forEach(function (type) {
    es.addEventListener(type, function () { es.close(); live.textContent = "turn ended"; refresh(); });
  });
  es.onerror = function () { live.textContent = "live: reconnecting…"; };
})();
