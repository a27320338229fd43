// fleetwire dashboard charts: time series kept in the page and drawn as plain SVG.
//
// No library: a line chart of a few series over a fixed window is ~150 lines of SVG, and the
// page stays one origin with no third-party code (CSP script-src 'self'). Two pieces:
//
// * `TimeSeries`: samples (t in ms, value) of one named line, oldest dropped past the window.
//   `Buckets`: counts per fixed-width time bucket (events per bucket: rates, sums per minute).
// * `drawChart(svg, lines, opts)`: redraws an <svg> with a y axis scaled to the largest value,
//   a time axis of the window ending now, one <path class="line"> per series (its `d` is empty
//   while the series is) and a legend. Everything is created with createElementNS/textContent.
"use strict";

(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#2b6cb0", "#1f8a4c", "#c53030", "#b7791f", "#6b46c1", "#0e7490", "#be185d", "#4a5568"];

  class TimeSeries {
    constructor(windowMs) {
      this.windowMs = windowMs;
      this.points = []; // [t, v], t increasing
    }
    add(t, v) {
      if (!Number.isFinite(v)) return;
      this.points.push([t, v]);
      this.trim(t);
    }
    trim(now) {
      const oldest = now - this.windowMs;
      let drop = 0;
      while (drop < this.points.length && this.points[drop][0] < oldest) drop++;
      if (drop) this.points.splice(0, drop);
    }
    last() {
      return this.points.length ? this.points[this.points.length - 1][1] : null;
    }
  }

  // Values summed per bucket of `bucketMs`; `points(now, scale)` gives one point per bucket of the
  // window, empty buckets as 0, so a rate that stops falls to 0 instead of holding its last value.
  class Buckets {
    constructor(windowMs, bucketMs) {
      this.windowMs = windowMs;
      this.bucketMs = bucketMs;
      this.sums = new Map(); // bucket start -> sum
      this.first = null; // first bucket anything was counted in (the line starts there)
    }
    add(t, v = 1) {
      const b = Math.floor(t / this.bucketMs) * this.bucketMs;
      this.sums.set(b, (this.sums.get(b) || 0) + v);
      if (this.first === null || b < this.first) this.first = b;
    }
    points(now, scale = 1, since = null) {
      const end = Math.floor(now / this.bucketMs) * this.bucketMs;
      const start = Math.max(end - this.windowMs, since === null ? (this.first === null ? end : this.first) : since);
      for (const b of this.sums.keys()) if (b < end - this.windowMs) this.sums.delete(b);
      const out = [];
      // A bucket's value is drawn at its end (the last, still filling, bucket at now).
      for (let b = Math.floor(start / this.bucketMs) * this.bucketMs; b <= end; b += this.bucketMs) {
        out.push([Math.min(b + this.bucketMs, now), (this.sums.get(b) || 0) * scale]);
      }
      return out;
    }
  }

  function node(tag, attrs, text) {
    const n = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, String(v));
    if (text !== undefined) n.textContent = String(text);
    return n;
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function fmt(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1000) return `${(v / 1000).toFixed(a >= 10000 ? 0 : 1)}k`;
    if (a >= 10) return v.toFixed(0);
    if (a >= 1) return v.toFixed(1).replace(/\.0$/, "");
    return v.toPrecision(2);
  }

  function clock(t, seconds) {
    const d = new Date(t);
    const two = (n) => String(n).padStart(2, "0");
    return `${two(d.getHours())}:${two(d.getMinutes())}${seconds ? ":" + two(d.getSeconds()) : ""}`;
  }

  // lines: [{name, points: [[t, v]...], color?}]; opts: {now, windowMs, unit, width, height}
  function drawChart(svg, lines, opts) {
    const width = opts.width || 360;
    const height = opts.height || 150;
    const pad = { left: 38, right: 8, top: 8, bottom: 34 };
    const w = width - pad.left - pad.right;
    const h = height - pad.top - pad.bottom;
    const t1 = opts.now;
    const t0 = t1 - opts.windowMs;
    let max = 0;
    for (const line of lines) for (const [, v] of line.points) if (v > max) max = v;
    const ymax = niceMax(max);
    const x = (t) => pad.left + (w * (Math.max(t, t0) - t0)) / (t1 - t0);
    const y = (v) => pad.top + h - (h * v) / ymax;

    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("preserveAspectRatio", "none");
    const parts = [];
    for (const frac of [0, 0.5, 1]) {
      const yy = y(ymax * frac);
      parts.push(node("line", { x1: pad.left, x2: pad.left + w, y1: yy, y2: yy, class: "grid" }));
      parts.push(node("text", { x: pad.left - 4, y: yy + 3, class: "tick", "text-anchor": "end" }, fmt(ymax * frac)));
    }
    for (const frac of [0, 0.5, 1]) {
      const t = t0 + frac * (t1 - t0);
      const anchor = frac === 0 ? "start" : frac === 1 ? "end" : "middle";
      parts.push(node("text", { x: x(t), y: pad.top + h + 12, class: "tick", "text-anchor": anchor }, clock(t, opts.windowMs < 600000)));
    }
    let lx = pad.left;
    lines.forEach((line, i) => {
      const color = line.color || PALETTE[i % PALETTE.length];
      let d = "";
      for (const [t, v] of line.points) {
        if (t < t0) continue;
        d += `${d ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      }
      // A single sample still shows: a dot-length segment.
      if (d && !d.includes("L")) d += `h1`;
      const path = node("path", { d, class: "line", stroke: color, fill: "none" });
      path.dataset.series = line.name;
      parts.push(path);
      const last = line.points.length ? line.points[line.points.length - 1][1] : null;
      const label = `${line.name}${last === null ? "" : " " + fmt(last)}`;
      parts.push(node("rect", { x: lx, y: height - 12, width: 8, height: 8, fill: color }));
      const text = node("text", { x: lx + 11, y: height - 4, class: "legend" }, label);
      parts.push(text);
      lx += 18 + label.length * 5.6;
    });
    if (opts.unit) parts.push(node("text", { x: width - pad.right, y: pad.top + 8, class: "unit", "text-anchor": "end" }, opts.unit));
    svg.replaceChildren(...parts);
  }

  // Nearest-rank percentile of a list of numbers (null when empty).
  function percentile(values, q) {
    if (!values.length) return null;
    const sorted = [...values].sort((a, b) => a - b);
    return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1))];
  }

  window.fleetCharts = { TimeSeries, Buckets, drawChart, percentile, PALETTE };
})();
