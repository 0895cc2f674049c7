// echo_p2p monitor page: reads /api/status and /api/history every POLL_MS and draws the header, alerts, three
// charts (inline SVG: the trainers' reward, the held-out evaluation, rollouts consumed) and the peer table. Everything shown comes from peers and is untrusted: it enters the
// document only through textContent and attribute values, never as markup. Nothing is fetched from
// anywhere but this server.
"use strict";
(function () {
  const POLL_MS = 2000;
  const MAX_SAMPLES = 3600;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const SEVERITIES = ["critical", "warning", "info"];
  const samples = [];
  let lastSampleTime = 0;

  const byId = (id) => document.getElementById(id);

  function fmt(value, digits) {
    if (value === null || value === undefined) return "–";
    if (typeof value === "number") return digits === undefined ? String(value) : value.toFixed(digits);
    return String(value);
  }

  function shortId(id) {
    const s = String(id || "");
    return s.length > 14 ? "…" + s.slice(-12) : s;
  }

  function cell(row, value, className, title) {
    const td = document.createElement("td");
    td.textContent = value;
    if (className) td.className = className;
    if (title) td.setAttribute("title", title);
    row.appendChild(td);
    return td;
  }

  function setText(id, value) {
    byId(id).textContent = value;
  }

  function renderHeader(st) {
    const run = st.run || {};
    const sum = st.summary || {};
    setText("run-id", fmt(st.run_id));
    document.title = "echo_p2p monitor: " + fmt(st.run_id);
    setText("model", fmt(run.model));
    setText("task", fmt(run.task));
    setText("mode", fmt(run.mode));
    setText("version", fmt(sum.newest_version));
    setText("vpm", fmt(sum.versions_per_minute, 1));
    setText("trainers", fmt(sum.trainers));
    setText("inference", fmt(sum.inference));
    setText("reward", fmt(sum.reward, 3));
    setText("eval-accuracy", fmt(sum.eval_accuracy, 3));
    setText("consumed", fmt(sum.rollouts_consumed));
    setText("trust", fmt(st.trust));
    setText("updated", new Date(st.time * 1000).toLocaleTimeString());
  }

  function renderAlerts(st) {
    const list = byId("alerts");
    list.replaceChildren();
    const alerts = Array.isArray(st.alerts) ? st.alerts : [];
    if (alerts.length === 0) {
      const li = document.createElement("li");
      li.className = "none";
      li.textContent = "none";
      list.appendChild(li);
      return;
    }
    for (const a of alerts) {
      const li = document.createElement("li");
      li.className = SEVERITIES.includes(a.severity) ? a.severity : "info";
      li.dataset.code = fmt(a.code);
      const code = document.createElement("span");
      code.className = "code";
      code.textContent = fmt(a.code);
      li.appendChild(code);
      li.appendChild(document.createTextNode(fmt(a.message)));
      const peers = Array.isArray(a.peers) ? a.peers : [];
      if (peers.length) {
        const span = document.createElement("span");
        span.className = "peers";
        span.textContent = peers.slice(0, 5).map(shortId).join(", ") + (peers.length > 5 ? ", …" : "");
        li.appendChild(span);
      }
      list.appendChild(li);
    }
  }

  function renderPeers(st) {
    const body = byId("peers").tBodies[0];
    body.replaceChildren();
    const peers = Array.isArray(st.peers) ? st.peers : [];
    const sum = st.summary || {};
    const bound = typeof sum.max_staleness === "number" ? sum.max_staleness : 4;
    for (const p of peers) {
      const tr = document.createElement("tr");
      const impostor = p.trusted === false;
      if (impostor) tr.className = "impostor";
      else if (p.role === "inference" && typeof p.lag === "number" && p.lag > bound) tr.className = "lagging";
      cell(tr, shortId(p.peer_id), "peer", fmt(p.peer_id));
      cell(tr, fmt(p.role), "role");
      const stalled = !impostor && Array.isArray(p.stalled) && p.stalled.length > 0;
      if (impostor) cell(tr, "IMPOSTOR", "state impostor");
      else if (stalled) cell(tr, "STALLED", "state stalled", p.stalled.map(String).join(", "));
      else cell(tr, fmt(p.state), "state");
      cell(tr, fmt(p.policy_version), "num version");
      cell(tr, fmt(p.lag), "num lag");
      cell(tr, fmt(p.reachability), "reach", (Array.isArray(p.maddrs) ? p.maddrs : []).join("\n"));
      cell(tr, fmt(p.tokens_per_second, 1), "num");
      cell(tr, fmt(p.rollouts_per_second, 2), "num");
      cell(tr, fmt(p.chunks_served), "num");
      cell(tr, p.role === "trainer" ? fmt(p.buffered_groups) : "", "num");
      cell(tr, typeof p.last_seen_s === "number" ? p.last_seen_s.toFixed(0) + " s ago" : "–", "num");
      cell(tr, fmt(p.software_version), "software", fmt(p.software_version));
      body.appendChild(tr);
    }
    const total = typeof sum.peers_total === "number" ? sum.peers_total : peers.length;
    const dir = st.directory || {};
    const unseen = typeof sum.peers_unseen === "number" ? sum.peers_unseen : 0;
    const shown = total > peers.length ? `${peers.length} of ${total} shown` : `${total}`;
    const notSeen = typeof dir.total === "number"
      ? `; not seen: ~${unseen} (${fmt(dir.known)} of ${dir.total} directory buckets read)` : "";
    setText("peer-count", `(${shown}${notSeen})`);
  }

  function svgEl(tag, attrs, text) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // A line chart into an <svg viewBox="0 0 600 220">: one polyline per series ({points: [[t, y]...], cls}, t in
  // seconds); the y range covers the data and [lo, hi] (null: the data's own).
  function drawChart(svg, series, digits, lo, hi) {
    svg.replaceChildren();
    const W = 600, H = 220, L = 52, R = 12, T = 10, B = 28;
    const lines = series.map((s) => ({
      cls: s.cls,
      pts: s.points.filter((p) => typeof p[1] === "number" && isFinite(p[1])),
    }));
    const all = lines.flatMap((s) => s.pts);
    svg.appendChild(svgEl("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
    svg.appendChild(svgEl("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
    if (all.length === 0) {
      svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
      return;
    }
    let ymin = Math.min(...all.map((p) => p[1]), lo === null ? Infinity : lo);
    let ymax = Math.max(...all.map((p) => p[1]), hi === null ? -Infinity : hi);
    if (ymax - ymin < 1e-9) { ymin -= 0.5; ymax += 0.5; }
    const t0 = Math.min(...all.map((p) => p[0]));
    const t1 = Math.max(...all.map((p) => p[0]), t0 + 1);
    const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
    const y = (v) => H - B - ((v - ymin) / (ymax - ymin)) * (H - T - B);
    for (const frac of [0, 0.5, 1]) {
      const v = ymin + frac * (ymax - ymin);
      svg.appendChild(svgEl("line", { class: "grid", x1: L, y1: y(v), x2: W - R, y2: y(v) }));
      svg.appendChild(svgEl("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, v.toFixed(digits)));
    }
    const span = t1 - t0;
    svg.appendChild(svgEl("text", { x: L, y: H - 8 }, "-" + span.toFixed(0) + " s"));
    svg.appendChild(svgEl("text", { x: W - R, y: H - 8, "text-anchor": "end" }, "now"));
    for (const line of lines) {
      if (line.pts.length === 0) continue;
      const d = line.pts.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ");
      svg.appendChild(svgEl("polyline", { class: "line " + line.cls, points: d }));
      const last = line.pts[line.pts.length - 1];
      svg.appendChild(svgEl("circle", { class: "dot " + line.cls, cx: x(last[0]), cy: y(last[1]), r: 3 }));
    }
  }

  function renderCharts() {
    const series = (key, cls) => ({ points: samples.map((s) => [s.time, s[key]]), cls: cls });
    drawChart(byId("chart-reward"), [series("reward", "reward")], 2, 0, 1);
    drawChart(
      byId("chart-eval"), [series("eval_accuracy", "eval-accuracy"), series("eval_reward", "eval-reward")], 2, 0, 1
    );
    drawChart(byId("chart-consumed"), [series("rollouts_consumed", "consumed")], 0, 0, null);
  }

  async function getJson(url) {
    const response = await fetch(url, { cache: "no-store" });
    if (!response.ok) throw new Error(url + ": HTTP " + response.status);
    return response.json();
  }

  async function tick() {
    const conn = byId("conn");
    try {
      const st = await getJson("/api/status");
      const hist = await getJson("/api/history?since=" + encodeURIComponent(String(lastSampleTime)));
      for (const s of Array.isArray(hist.samples) ? hist.samples : []) {
        if (typeof s.time === "number" && s.time > lastSampleTime) {
          samples.push(s);
          lastSampleTime = s.time;
        }
      }
      samples.splice(0, Math.max(0, samples.length - MAX_SAMPLES));
      renderHeader(st);
      renderAlerts(st);
      renderPeers(st);
      renderCharts();
      conn.textContent = "live";
      conn.className = "conn ok";
      document.body.dataset.state = "ok";
    } catch (err) {
      conn.textContent = "no answer from the monitor (" + String(err.message || err).slice(0, 80) + ")";
      conn.className = "conn lost";
      document.body.dataset.state = "lost";
    } finally {
      setTimeout(tick, POLL_MS);
    }
  }

  tick();
})();
