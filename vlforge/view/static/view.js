// vlforge view: the run list, curves (plotly.js), the GRPO rollout browser and the eval browser.
// Served, it reads /api/runs and /api/run/I and polls them (a running run grows); exported
// (vlforge view --export), window.VLFORGE_EXPORT holds every run with its images inlined.
// Text from a run (prompts, answers) is set as text, never as HTML: a model can write anything.
"use strict";

const EXPORTED = window.VLFORGE_EXPORT || null;
const state = { runs: [], data: {}, shown: new Set(), metrics: [] };
const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function fmt(v) {
  if (v === null || v === undefined) return "–";
  return typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(4)) : String(v);
}

function imageSrc(i, name) {
  if (EXPORTED) return EXPORTED.runs[i].images[name] || "";
  return `img/${i}/${name}`;
}

async function load() {
  if (EXPORTED) {
    state.runs = EXPORTED.runs;
    EXPORTED.runs.forEach((r, i) => { state.data[i] = r; });
  } else {
    state.runs = await (await fetch("api/runs")).json();
    await Promise.all(state.runs.map(async (_, i) => { state.data[i] = await (await fetch(`api/run/${i}`)).json(); }));
  }
  if (state.shown.size === 0) state.runs.forEach((_, i) => state.shown.add(i));
  render();
  $("status").textContent = EXPORTED ? "exported report" : `updated ${new Date().toLocaleTimeString()}`;
}

function render() {
  renderRuns();
  renderCharts();
  fillRunSelect($("rollout-run"), (d) => d.grpo && d.grpo.length);
  fillRunSelect($("eval-run"), (d) => d.eval && d.eval.length);
  renderRollouts(false);
  renderEvals(false);
}

function renderRuns() {
  const body = $("runs").querySelector("tbody");
  body.replaceChildren(...state.runs.map((r, i) => {
    const box = el("input", { type: "checkbox" });
    box.checked = state.shown.has(i);
    box.addEventListener("change", () => { box.checked ? state.shown.add(i) : state.shown.delete(i); renderCharts(); });
    const config = Object.entries(r.config || {}).map(([k, v]) => `${k}=${Array.isArray(v) ? v.join(",") : v}`).join("  ");
    return el("tr", { "data-run": r.name },
      el("td", {}, box), el("td", { text: r.name, title: r.path }), el("td", { text: r.recipe }),
      el("td", { class: `state state-${r.state}`, text: r.state }), el("td", { text: String(r.last_step) }),
      el("td", { class: "config", text: config }));
  }));
}

// Exponential moving average with bias correction (TensorBoard's smoothing)
function smooth(ys, weight) {
  if (!weight) return ys;
  let last = 0, n = 0;
  return ys.map((y) => { last = last * weight + (1 - weight) * y; n += 1; return last / (1 - Math.pow(weight, n)); });
}

function metricKeys() {
  const keys = new Set();
  for (const i of state.shown) for (const row of (state.data[i] || {}).metrics || [])
    for (const [k, v] of Object.entries(row)) if (typeof v === "number" && k !== "step" && k !== "time_unix") keys.add(k);
  const words = $("metric-filter").value.split(/[\s,]+/).filter(Boolean);  // any of the words
  return [...keys].filter((k) => !words.length || words.some((w) => k.includes(w))).sort();
}

function series(rows, key, xaxis) {
  const pts = rows.filter((r) => typeof r[key] === "number" && Number.isFinite(r[key]));
  let start = null;
  const times = {};  // eval rows carry no time: they take their step's
  for (const r of rows) if (r.time_unix) { times[r.step] = r.time_unix; if (start === null) start = r.time_unix; }
  const xs = pts.map((r) => xaxis === "time" ? ((times[r.step] || start) - start) / 60 : r.step);
  return { x: xs, y: pts.map((r) => r[key]) };
}

function renderCharts() {
  const xaxis = $("xaxis").value, weight = parseFloat($("smooth").value);
  $("smooth-value").textContent = weight.toFixed(2);
  const keys = metricKeys();
  const box = $("charts");
  for (const div of [...box.children]) if (!keys.includes(div.dataset.metric)) div.remove();
  for (const key of keys) {
    let div = box.querySelector(`[data-metric="${CSS.escape(key)}"]`);
    if (!div) { div = el("div", { class: "chart", "data-metric": key }); box.append(div); }
    const traces = [];
    for (const i of [...state.shown].sort()) {
      const rows = (state.data[i] || {}).metrics || [];
      const s = series(rows, key, xaxis);
      if (!s.x.length) continue;
      traces.push({ x: s.x, y: smooth(s.y, weight), name: state.runs[i].name, mode: "lines+markers",
                    type: "scatter", marker: { size: 5 } });
    }
    Plotly.react(div, traces, {
      title: { text: key, font: { size: 13 } }, margin: { l: 50, r: 10, t: 30, b: 35 }, showlegend: traces.length > 1,
      legend: { orientation: "h" }, xaxis: { title: { text: xaxis === "time" ? "minutes" : "step" } },
    }, { displaylogo: false, responsive: true, displayModeBar: false });
  }
}

function fillRunSelect(select, has) {
  const before = select.value;
  const options = state.runs.map((r, i) => [r, i]).filter(([, i]) => state.data[i] && has(state.data[i]));
  select.replaceChildren(...options.map(([r, i]) => el("option", { value: String(i), text: r.name })));
  if ([...select.options].some((o) => o.value === before)) select.value = before;
}

function stepsOf(rows) { return [...new Set(rows.map((r) => r.step))].sort((a, b) => a - b); }

function keepResponse(r) {
  const how = $("rollout-filter").value, min = parseFloat($("rollout-min").value);
  if (!Number.isNaN(min) && r.reward < min) return false;
  if (how === "correct") return r.correct;
  if (how === "wrong") return !r.correct;
  if (how === "positive") return r.advantage !== null && r.advantage > 0;
  if (how === "negative") return r.advantage !== null && r.advantage < 0;
  return true;
}

function renderRollouts(userMoved) {
  const i = $("rollout-run").value, box = $("rollouts");
  if (i === "") { box.replaceChildren(el("p", { text: "no GRPO samples (samples/grpo.jsonl) in these runs" })); return; }
  const rows = state.data[i].grpo, steps = stepsOf(rows), slider = $("rollout-step");
  const atEnd = Number(slider.value) >= Number(slider.max);
  slider.max = String(steps.length - 1);
  if (!userMoved && atEnd) slider.value = slider.max;  // follows a running run's newest step
  const step = steps[Number(slider.value)];
  $("rollout-step-value").textContent = `${step} (${Number(slider.value) + 1} of ${steps.length} logged)`;
  box.replaceChildren(...rows.filter((g) => g.step === step).map((g) => groupView(i, g)));
}

function groupView(i, g) {
  const head = el("tr", {}, ["response", "reward", ...Object.keys(g.responses[0].rewards).map(shortName),
                             "advantage", "length", "truncated", "correct"].map((h) => el("th", { text: h })));
  const rows = g.responses.filter(keepResponse).map((r) => {
    const sign = r.advantage === null ? "" : r.advantage > 0 ? "positive" : r.advantage < 0 ? "negative" : "";
    const text = el("td", {}, r.turns ? r.turns.map((t) => turnView(i, t)) : el("div", { class: "response-text", text: r.text }));
    return el("tr", { class: `response ${sign}` }, text, el("td", { class: "reward", text: fmt(r.reward) }),
      ...Object.values(r.rewards).map((v) => el("td", { text: fmt(v) })),
      el("td", { class: "adv", text: r.advantage === null ? "not trained" : fmt(r.advantage) }),
      el("td", { text: String(r.length) }), el("td", { text: r.truncated ? "yes" : "" }),
      el("td", { class: r.correct ? "correct" : "wrong", text: r.correct ? "✓" : "✗" }));
  });
  return el("div", { class: "group", "data-group": String(g.group) },
    el("div", { class: "prompt" }, ...g.images.map((n) => el("img", { src: imageSrc(i, n), alt: "prompt image" })),
       el("p", { text: g.prompt }), el("p", { class: "reference", text: `reference: ${g.reference}` }),
       el("p", { class: "config", text: g.source })),
    el("table", {}, el("thead", {}, head), el("tbody", {}, rows)));
}

function shortName(name) { return name.includes(":") ? name.split(":").pop() : name.split("/").pop(); }

function turnView(i, t) {
  const label = t.role === "tool" ? `tool ${t.name}${t.ok === false ? " (error)" : ""}` : "assistant";
  return el("div", { class: `turn ${t.role}` }, el("b", { text: label }),
    ...(t.images || []).map((n) => el("img", { src: imageSrc(i, n), alt: "tool image" })),
    el("div", { class: "response-text", text: t.content }));
}

function renderEvals() {
  const i = $("eval-run").value, box = $("evals");
  if (i === "") { box.replaceChildren(el("p", { text: "no evaluation samples (samples/eval.jsonl) in these runs" })); return; }
  const rows = state.data[i].eval, steps = stepsOf(rows);
  for (const [id, pick] of [["eval-a", 0], ["eval-b", steps.length - 1]]) {
    const select = $(id), before = select.value;
    select.replaceChildren(...steps.map((s) => el("option", { value: String(s), text: `step ${s}` })));
    select.value = steps.map(String).includes(before) ? before : String(steps[pick]);
  }
  const a = Number($("eval-a").value), b = Number($("eval-b").value);
  const at = (s) => Object.fromEntries(rows.filter((r) => r.step === s).map((r) => [r.probe, r]));
  const A = at(a), B = at(b);
  const side = (r, which, s) => r ? el("div", { class: `side ${which}` }, el("b", { text: `step ${s}` }),
    el("div", { class: `answer ${r.correct ? "correct" : "wrong"}`, text: `${r.correct ? "✓" : "✗"} ${r.answer}` }))
    : el("div", { class: `side ${which}`, text: `not evaluated at step ${s}` });
  box.replaceChildren(...Object.keys({ ...A, ...B }).map((p) => {
    const r = A[p] || B[p];
    const cls = `probe${A[p] && !A[p].correct ? " wrong-a" : ""}${B[p] && !B[p].correct ? " wrong-b" : ""}`;
    return el("div", { class: cls, "data-probe": p },
      el("div", {}, ...r.images.map((n) => el("img", { src: imageSrc(i, n), alt: "probe image" }))),
      el("div", { class: "side" }, el("p", { text: r.question }), el("p", { class: "reference", text: `reference: ${r.reference}` })),
      side(A[p], "a", a), side(B[p], "b", b));
  }));
}

for (const id of ["xaxis", "smooth", "metric-filter"]) $(id).addEventListener("input", renderCharts);
for (const id of ["rollout-run", "rollout-filter", "rollout-min"]) $(id).addEventListener("input", () => renderRollouts(false));
$("rollout-step").addEventListener("input", () => renderRollouts(true));
for (const id of ["eval-run", "eval-a", "eval-b"]) $(id).addEventListener("input", renderEvals);
load();
if (!EXPORTED) setInterval(load, 5000);
