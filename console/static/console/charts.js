// Draws every chart of a page with uPlot from the JSON the server embedded next to it.
(function () {
  "use strict";
  var palette = ["#2f5bd3", "#1f7a4d", "#a86400", "#b3261e", "#6b4fbb", "#0e7c86", "#8a5a44", "#5d6677", "#9aa3b2"];
  function draw(area) {
    var data = JSON.parse(document.getElementById(area.dataset.chart).textContent);
    var series = [{}].concat(data.series.map(function (s, i) {
      return { label: s.label, stroke: palette[i % palette.length], width: 2 };
    }));
    var opts = {
      width: Math.max(320, area.clientWidth),
      height: 300,
      series: series,
      axes: [{}, { label: area.dataset.label, size: 70 }],
      scales: { x: { time: true } }
    };
    area.innerHTML = "";
    var plot = new uPlot(opts, [data.x].concat(data.series.map(function (s) { return s.values; })), area);
    area.dataset.drawn = "true";
    window.addEventListener("resize", function () { plot.setSize({ width: Math.max(320, area.clientWidth), height: 300 }); });
  }
  document.querySelectorAll("[data-chart]").forEach(draw);
})();
