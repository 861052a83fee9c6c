// The report's behaviour: the en/zh switch, folded table rows, and the zoomable timeline.
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";

  function setLang(lang) {
    document.body.dataset.lang = lang;
    document.documentElement.lang = lang;
    document.querySelectorAll("[data-en]").forEach(function (el) {
      el.textContent = el.dataset[lang];
    });
    document.querySelectorAll("table.comm").forEach(function (t) {
      t.hidden = t.dataset.lang !== lang;
    });
    ["en", "zh"].forEach(function (l) {
      var b = document.getElementById("lang-" + l);
      if (b) { b.classList.toggle("on", l === lang); }
    });
  }
  document.getElementById("lang-en").addEventListener("click", function () { setLang("en"); });
  document.getElementById("lang-zh").addEventListener("click", function () { setLang("zh"); });

  document.querySelectorAll("button.fold").forEach(function (b) {
    b.addEventListener("click", function () {
      var table = b.closest("table");
      var open = b.textContent === "▸";
      table.querySelectorAll('tr.member[data-parent="' + b.dataset.row + '"]').forEach(
        function (tr) { tr.hidden = !open; });
      b.textContent = open ? "▾" : "▸";
    });
  });

  var data = JSON.parse(document.getElementById("tl-data").textContent);
  var box = document.getElementById("timeline");
  var LABEL = 110, ROW = 14, GAP = 8, WIDTH = 1200;
  var colours = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#9d755d",
                 "#eeca3b", "#ff9da6", "#bab0ac"];
  var tMin = Infinity, tMax = -Infinity;
  data.ev.forEach(function (e) { tMin = Math.min(tMin, e[2]); tMax = Math.max(tMax, e[3]); });
  if (!data.ev.length) { tMin = 0; tMax = 1; }
  var view = [tMin, tMax];
  var layout = data.ranks.map(function (rank) {  // lanes used by each rank, compute first
    var used = {};
    data.ev.forEach(function (e) { if (e[0] === rank) { used[e[1]] = true; } });
    return { rank: rank, lanes: Object.keys(used).map(Number).sort(function (a, b) { return a - b; }) };
  });

  function el(name, attrs, parent) {
    var node = document.createElementNS(NS, name);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (parent) { parent.appendChild(node); }
    return node;
  }

  function draw() {
    box.textContent = "";
    var height = 0;
    layout.forEach(function (l) { height += l.lanes.length * ROW + GAP; });
    var svg = el("svg", { viewBox: "0 0 " + WIDTH + " " + (height + 20), id: "tl-svg" }, box);
    var span = view[1] - view[0] || 1, scale = (WIDTH - LABEL - 10) / span;
    var x = function (t) { return LABEL + (t - view[0]) * scale; };
    var y = 0, laneY = {};
    layout.forEach(function (l) {
      var g = el("g", { "class": "lane", "data-rank": l.rank }, svg);
      el("text", { x: 2, y: y + 11, "class": "rl" }, g).textContent = "rank " + l.rank;
      laneY[l.rank] = {};
      l.lanes.forEach(function (lane, i) {
        laneY[l.rank][lane] = y + i * ROW;
        el("text", { x: 52, y: y + i * ROW + 11, "class": "kl" }, g).textContent = data.lanes[lane];
      });
      l.g = g;
      y += l.lanes.length * ROW + GAP;
      el("line", { x1: 0, x2: WIDTH, y1: y - GAP / 2, y2: y - GAP / 2, "class": "sep" }, svg);
    });
    var byRank = {};
    layout.forEach(function (l) { byRank[l.rank] = l; });
    data.ev.forEach(function (e) {
      if (e[3] < view[0] || e[2] > view[1]) { return; }
      var l = byRank[e[0]], x0 = Math.max(x(e[2]), LABEL), x1 = Math.min(x(e[3]), WIDTH);
      var w = Math.max(x1 - x0, 0.6);
      if (e[5] && laneY[e[0]][0] !== undefined) {  // async: over the compute it overlaps too
        el("rect", { x: x0, y: laneY[e[0]][0], width: w, height: ROW - 2, "class": "ov" }, l.g);
      }
      var r = el("rect", { x: x0, y: laneY[e[0]][e[1]] + 1, width: w, height: ROW - 3,
                           fill: colours[e[1] % colours.length], "class": e[5] ? "a" : "s" }, l.g);
      el("title", {}, r).textContent = data.names[e[4]] + " — step " + e[6] + ", " +
        ((e[3] - e[2]) / 1000).toFixed(3) + " ms" + (e[5] ? " (async)" : "");
    });
    el("text", { x: LABEL, y: height + 14, "class": "kl" }, svg).textContent =
      (view[0] / 1e6).toFixed(4) + " s";
    el("text", { x: WIDTH - 10, y: height + 14, "class": "kl", "text-anchor": "end" }, svg)
      .textContent = (view[1] / 1e6).toFixed(4) + " s";
    var which = data.steps.length < data.of ? "steps " + data.steps[0] + ".." +
      data.steps[data.steps.length - 1] + " of " + data.of + " recorded; " : "";
    document.getElementById("tl-info").textContent = which + "showing " +
      ((view[1] - view[0]) / 1000).toFixed(2) + " ms of " + ((tMax - tMin) / 1000).toFixed(2) +
      " ms; wheel zooms, drag pans";
  }

  function zoom(factor, centre) {
    var c = centre === undefined ? (view[0] + view[1]) / 2 : centre;
    var lo = c - (c - view[0]) * factor, hi = c + (view[1] - c) * factor;
    view = [Math.max(tMin, lo), Math.min(tMax, hi)];
    if (view[1] - view[0] < 1) { view = [c - 0.5, c + 0.5]; }
    draw();
  }
  function timeAt(clientX) {
    var r = box.getBoundingClientRect();
    var sx = (clientX - r.left) * WIDTH / r.width;
    return view[0] + (sx - LABEL) / (WIDTH - LABEL - 10) * (view[1] - view[0]);
  }
  box.addEventListener("wheel", function (ev) {
    ev.preventDefault();
    zoom(ev.deltaY < 0 ? 0.7 : 1 / 0.7, timeAt(ev.clientX));
  }, { passive: false });
  var dragging = null;
  box.addEventListener("mousedown", function (ev) { dragging = [ev.clientX, view.slice()]; });
  window.addEventListener("mouseup", function () { dragging = null; });
  window.addEventListener("mousemove", function (ev) {
    if (!dragging) { return; }
    var r = box.getBoundingClientRect();
    var dt = (dragging[0] - ev.clientX) * WIDTH / r.width / (WIDTH - LABEL - 10) *
      (dragging[1][1] - dragging[1][0]);
    dt = Math.max(tMin - dragging[1][0], Math.min(tMax - dragging[1][1], dt));
    view = [dragging[1][0] + dt, dragging[1][1] + dt];
    draw();
  });
  document.getElementById("zoom-in").addEventListener("click", function () { zoom(0.5); });
  document.getElementById("zoom-out").addEventListener("click", function () { zoom(2); });
  document.getElementById("zoom-reset").addEventListener("click", function () {
    view = [tMin, tMax]; draw();
  });

  setLang(document.body.dataset.lang || "en");
  draw();
  // ``#click=zh`` (tests, links): press the language button as a user would
  var m = /click=(en|zh)/.exec(location.hash);
  if (m) { document.getElementById("lang-" + m[1]).click(); }
  // ``#open=N``: press row N's fold button in the shown table (expands its layers)
  var o = /open=(\d+)/.exec(location.hash);
  if (o) {
    document.querySelectorAll('table.comm:not([hidden]) button.fold[data-row="' + o[1] + '"]')
      .forEach(function (b) { b.click(); });
  }
  var shown = document.createElement("pre");
  shown.id = "load-errors";
  shown.hidden = true;
  document.body.appendChild(shown);
  window.addEventListener("load", function () {
    shown.textContent = JSON.stringify(window.__errors);
    document.body.dataset.ready = "1";
  });
})();
