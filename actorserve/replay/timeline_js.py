"""The replay page's script: zoom for the timeline and the per-request diagram picker.

Plain JavaScript, no library, no network. It reads the axis (`timeline.Axis.to_json`) from
the page and repeats the axis arithmetic of `replay.timeline` (pieces at one scale, breaks
of fixed width, ticks on `timeline.nice_step` about every ``tick_px``), so zooming re-lays every
bar (``data-a``/``data-b``: ns from the axis origin), break and tick exactly as the server
drew them at zoom 1.

* Zoom: the ``+``/``−``/``fit`` buttons, or ctrl (alt) + wheel over the plot, which keeps
  the time under the pointer in place; ``+``/``-``/``0`` keys too.
* Diagrams: the ``<select>`` lists every request; picking one, or clicking its lane or its
  label, shows its lifecycle diagram (from a ``<template>`` shared by the requests that
  took the same path) and outlines its lane.
* A link can carry both: ``page.html#zoom=4&rid=ID`` opens zoomed in, that request shown.
* On load the plot's page position is written to ``data-box`` (the browser tests read it).
"""

SCRIPT = r"""
(function () {
  "use strict";
  const $ = (s, r) => (r || document).querySelector(s);
  const NS = "http://www.w3.org/2000/svg";
  const axis = JSON.parse($("#tl-axis").textContent);
  const plot = $("svg.timeline"), scroller = $(".tl-scroll"), labels = $("svg.tl-labels");
  const P = axis.pieces, base = axis.width;
  let zoom = 1, scale = 0, starts = [];

  function setWidth(w) {
    let total = 0;
    for (const p of P) total += p[1] - p[0];
    scale = (w - axis.brk * (P.length - 1)) / Math.max(total, 1);
    starts = [];
    let x = axis.left;
    for (const p of P) { starts.push(x); x += (p[1] - p[0]) * scale + axis.brk; }
  }
  function X(t) {
    let lo = 0, hi = P.length - 1;
    while (lo < hi) { const m = (lo + hi + 1) >> 1; if (P[m][0] <= t) lo = m; else hi = m - 1; }
    const a = P[lo][0], b = P[lo][1];
    if (t <= b || lo + 1 === P.length) return starts[lo] + Math.max(0, Math.min(t, b) - a) * scale;
    return starts[lo] + (b - a) * scale + axis.brk * (t - b) / (P[lo + 1][0] - b);
  }
  function T(x) {
    for (let i = P.length - 1; i >= 0; i--) {
      if (x < starts[i] && i > 0) continue;
      const a = P[i][0], b = P[i][1], end = starts[i] + (b - a) * scale;
      if (x <= end || i + 1 === P.length) return a + Math.max(0, x - starts[i]) / scale;
      return b + (x - end) / axis.brk * (P[i + 1][0] - b);
    }
    return 0;
  }
  const UNITS = [["h", 3600e9], ["min", 60e9], ["s", 1e9], ["ms", 1e6], ["\u00b5s", 1e3]];
  function fmt(ns) {
    for (const [u, size] of UNITS) {
      if (Math.abs(ns) < size) continue;
      const v = ns / size, av = Math.abs(v);
      let t = av >= 100 ? v.toFixed(0) : av >= 10 ? v.toFixed(1) : v.toFixed(2);
      if (t.includes(".")) t = t.replace(/0+$/, "").replace(/\.$/, "");
      return t + " " + u;
    }
    return ns.toFixed(0) + " ns";
  }
  function decimal(r) {
    const mag = Math.pow(10, Math.floor(Math.log10(Math.max(r, 1))));
    return [1, 2, 5, 10].map(m => m * mag).find(s => s >= r);
  }
  function niceStep(raw) {
    if (raw <= 10e9) return decimal(raw);
    for (const s of axis.clock_steps) if (s * 1e9 >= raw) return s * 1e9;
    return decimal(raw / 3600e9) * 3600e9;
  }
  function breaks() {
    return P.slice(0, -1).map((p, i) => starts[i] + (p[1] - p[0]) * scale);
  }
  function drawTicks() {
    const g = $("g.ticks", plot), h = +plot.getAttribute("height");
    while (g.firstChild) g.removeChild(g.firstChild);
    const step = niceStep(axis.tick_px / scale);
    const gaps = breaks();
    let last = -1e9;
    for (const [a, b] of P) {
      for (let k = Math.ceil(a / step); k * step <= b; k++) {
        const x = X(k * step);
        if (x - last < 40 || gaps.some(g0 => g0 - 18 < x && x < g0 + axis.brk + 18)) continue;
        last = x;
        const line = document.createElementNS(NS, "line");
        for (const [k2, v] of [["x1", x], ["x2", x], ["y1", axis.axis_h - 6], ["y2", h]])
          line.setAttribute(k2, typeof v === "number" ? v.toFixed(1) : v);
        line.setAttribute("stroke", "#e2e8f0");
        const text = document.createElementNS(NS, "text");
        text.setAttribute("x", x.toFixed(1));
        text.setAttribute("y", axis.axis_h - 10);
        text.setAttribute("text-anchor", "middle");
        text.setAttribute("fill", "#475569");
        text.textContent = k ? fmt(k * step) : "0";
        g.appendChild(line); g.appendChild(text);
      }
    }
  }
  function relayout() {
    setWidth(base * zoom);
    plot.setAttribute("width", (axis.left + base * zoom + 30).toFixed(0));
    for (const el of plot.querySelectorAll("[data-a]")) {
      const x0 = X(+el.dataset.a), x1 = X(+el.dataset.b);
      const min = el.classList.contains("step") ? 1.5 : 2;
      el.setAttribute("x", x0.toFixed(1));
      el.setAttribute("width", (el.dataset.w ? +el.dataset.w : Math.max(x1 - x0, min)).toFixed(1));
    }
    const xs = breaks();
    for (const g of plot.querySelectorAll("g.break"))
      g.setAttribute("transform", "translate(" + xs[+g.dataset.gap].toFixed(1) + ",0)");
    drawTicks();
    const z = $("#tl-zoom");
    if (z) z.textContent = "\u00d7" + (zoom < 10 ? zoom.toFixed(2).replace(/\.?0+$/, "") : zoom.toFixed(0));
  }
  function zoomTo(z, anchor) {
    z = Math.min(Math.max(z, 1), 1 << 16);
    if (anchor === undefined) anchor = scroller.clientWidth / 2;
    const t = T(scroller.scrollLeft + anchor);
    zoom = z;
    relayout();
    scroller.scrollLeft = X(t) - anchor;
  }
  for (const b of document.querySelectorAll("[data-zoom]")) {
    b.addEventListener("click", () => {
      const k = b.dataset.zoom;
      zoomTo(k === "in" ? zoom * 2 : k === "out" ? zoom / 2 : 1);
    });
  }
  scroller.addEventListener("wheel", ev => {
    if (!ev.ctrlKey && !ev.altKey) return;
    ev.preventDefault();
    const r = scroller.getBoundingClientRect();
    zoomTo(zoom * (ev.deltaY < 0 ? 1.25 : 0.8), ev.clientX - r.left);
  }, {passive: false});
  document.addEventListener("keydown", ev => {
    if (ev.target.closest && ev.target.closest("select, input")) return;
    if (ev.key === "+" || ev.key === "=") zoomTo(zoom * 2);
    else if (ev.key === "-") zoomTo(zoom / 2);
    else if (ev.key === "0") zoomTo(1);
  });

  const map = JSON.parse($("#ov-map").textContent);
  const sel = $("#ov-select"), box = $("#overlay"), cap = $("#ov-caption");
  function show(rid) {
    const entry = map[rid];
    if (!entry) return;
    const tpl = document.getElementById(entry[0]);
    box.replaceChildren(tpl.content.cloneNode(true));
    cap.textContent = rid + " (" + entry[1] + ")";
    if (sel) sel.value = rid;
    for (const el of document.querySelectorAll(".lane.selected")) el.classList.remove("selected");
    for (const el of plot.querySelectorAll(".lane[data-rid]"))
      if (el.dataset.rid === rid) el.classList.add("selected");
  }
  if (sel) sel.addEventListener("change", () => show(sel.value));
  for (const svg of [plot, labels]) {
    svg.addEventListener("click", ev => {
      const el = ev.target.closest("[data-rid]");
      if (el) show(el.dataset.rid);
    });
  }
  setWidth(base);
  const hz = /(?:^#|&)zoom=([0-9.]+)/.exec(location.hash);
  if (hz) zoomTo(+hz[1], 0);
  const hr = /(?:^#|&)rid=([^&]+)/.exec(location.hash);
  if (hr) show(decodeURIComponent(hr[1]));
  const r = plot.getBoundingClientRect();
  plot.dataset.box = [r.left + window.scrollX, r.top + window.scrollY].map(v => v.toFixed(1)).join(",");
})();
"""
