// ctseg review: the batch's table (worst first), the viewer (NiiVue), the reviewer's marks.
// Every value shown is set as text, never as HTML: names and comments are the user's.
// NiiVue's bundle (a classic script before this module) sets window.niivue.
const { DRAG_MODE, Niivue, MULTIPLANAR_TYPE, SHOW_RENDER, SLICE_TYPE } = window.niivue;

// Label colours (0 background, 1 liver, 2 tumour): the same in the CSS swatches.
const COLOURS = { 1: [230, 80, 60], 2: [255, 215, 0] };
// Radiology's window presets as [width, level] in HU.
const WINDOWS = { abdomen: [400, 50], liver: [150, 30] };
const VERDICT_CLASS = { review: "review", "unlike the training data": "unlike", ok: "ok" };
const MARK_KEYS = { a: "accept", r: "reject", c: "needs correction" };

const state = { cases: [], marks: {}, kind: "predict", current: -1, viewing: false, nv: null };
const $ = (id) => document.getElementById(id);

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function number(value, digits = 1) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

async function request(path, options = {}) {
  const answer = await fetch(path, { credentials: "same-origin", ...options });
  const body = answer.headers.get("content-type")?.includes("json") ? await answer.json() : null;
  if (!answer.ok) throw new Error(body?.error || `${answer.status} ${answer.statusText}`);
  return body;
}

function showError(message) {
  $("error").hidden = !message;
  $("error").textContent = message || "";
}

// --- the batch --------------------------------------------------------------------------

async function loadBatch() {
  const batch = await request("/api/batch");
  state.cases = batch.cases;
  state.marks = batch.marks;
  state.kind = batch.kind;
  state.reviewer = batch.reviewer;
  $("folder").textContent = batch.folder;
  // An evaluation's cases have Dice but no stats files; a prediction's the other way round.
  document.body.classList.toggle("predictions", batch.kind !== "evaluate");
  document.body.classList.toggle("evaluation", batch.kind === "evaluate");
  renderTable();
}

function visibleCases() {
  const verdict = $("filter-verdict").value;
  const mark = $("filter-mark").value;
  return state.cases.filter((c) => {
    const known = VERDICT_CLASS[c.verdict] ? c.verdict : "none";
    const marked = state.marks[c.name]?.mark || "none";
    return (!verdict || known === verdict) && (!mark || marked === mark);
  });
}

function renderTable() {
  const body = document.querySelector("#cases tbody");
  body.replaceChildren();
  const shown = visibleCases();
  shown.forEach((c, index) => body.append(row(c, index)));
  const marked = state.cases.filter((c) => state.marks[c.name]?.mark).length;
  const flagged = state.cases.filter((c) => c.verdict !== "ok").length;
  $("progress").textContent =
    `${state.cases.length} scans, ${flagged} to look at; ${marked} marked` +
    (shown.length < state.cases.length ? `; ${shown.length} shown` : "");
  highlight();
}

function row(c, index) {
  const tr = element("tr");
  tr.dataset.name = c.name;
  tr.append(element("td", String(index + 1), "num"));
  const thumb = element("td", null, "thumb");
  if ("preview" in c.files) {
    const img = element("img");
    img.loading = "lazy";
    img.alt = "";
    img.src = fileUrl(c.name, c.files.preview);
    thumb.append(img);
  }
  tr.append(thumb, element("td", c.name, "name"));
  const verdict = element("td");
  verdict.append(element("span", c.verdict || "no verdict", `verdict ${VERDICT_CLASS[c.verdict] || ""}`));
  tr.append(verdict, element("td", number(c.score, 2), "num"));
  // The verdict's reason in the row; all of them in its tooltip and in the viewer.
  const reasons = [...c.reasons, ...c.problems];
  const more = reasons.length > 1 ? ` (+${reasons.length - 1} more)` : "";
  const reasonCell = element("td", (reasons[0] || "–") + more, "reasons");
  reasonCell.title = reasons.join("\n");
  tr.append(reasonCell);
  tr.append(element("td", number(c.liver_volume_ml), "num stat"));
  tr.append(element("td", number(c.tumour_volume_ml), "num stat"));
  tr.append(element("td", number(c.tumour_count, 0), "num stat"));
  tr.append(element("td", number(c.largest_tumour_diameter_mm), "num stat"));
  tr.append(element("td", number(c.tumour_burden_percent, 2), "num stat"));
  tr.append(element("td", number(c.dice?.liver, 3), "num dice"));
  tr.append(element("td", number(c.dice?.tumour, 3), "num dice"));
  const moreWarnings = c.warnings.length > 1 ? ` (+${c.warnings.length - 1} more)` : "";
  const warningCell = element("td", c.warnings.length ? c.warnings[0] + moreWarnings : "", "warnings");
  warningCell.title = c.warnings.join("\n");
  tr.append(warningCell);
  const mark = state.marks[c.name];
  const markCell = element("td");
  if (mark) {
    const label = (mark.mark || "comment") + (mark.comment ? " ✎" : "");
    const span = element("span", label, `mark ${(mark.mark || "").replace(" ", "-")}`);
    span.title = `${mark.comment}\n${mark.reviewer}, ${mark.at}`;
    markCell.append(span);
  }
  tr.append(markCell);
  tr.addEventListener("click", () => open(c.name));
  return tr;
}

function fileUrl(name, file) {
  return `/files/${encodeURIComponent(name)}/${file}`;
}

function highlight() {
  const name = state.cases[state.current]?.name;
  for (const tr of document.querySelectorAll("#cases tbody tr")) {
    const on = tr.dataset.name === name;
    tr.classList.toggle("current", on);
    if (on && !state.viewing) tr.scrollIntoView({ block: "nearest" });
  }
}

function step(delta) {
  const shown = visibleCases();
  if (!shown.length) return;
  const at = shown.findIndex((c) => c.name === state.cases[state.current]?.name);
  const next = shown[Math.max(0, Math.min(shown.length - 1, at < 0 ? 0 : at + delta))];
  state.current = state.cases.indexOf(next);
  if (state.viewing) open(next.name);
  else highlight();
}

// --- the viewer -------------------------------------------------------------------------

async function viewer() {
  if (state.nv) return state.nv;
  const nv = new Niivue({
    backColor: [0, 0, 0, 1],
    show3Dcrosshair: true,
    isColorbar: false,
    dragAndDropEnabled: false,
    multiplanarShowRender: SHOW_RENDER.ALWAYS,
    multiplanarLayout: MULTIPLANAR_TYPE.GRID,
    isRadiologicalConvention: true, // as 3D Slicer, ITK-SNAP and OHIF show CT
    dragMode: DRAG_MODE.windowing, // right-drag: width and level, as in a PACS viewer
  });
  await nv.attachToCanvas($("gl"));
  nv.onLocationChange = (data) => showValues(data.values?.map((v) => v.value));
  $("gl").addEventListener("mousemove", (event) => hover(nv, event));
  state.nv = nv;
  return nv;
}

function labelColours(showLiver, showTumour) {
  return {
    R: [0, COLOURS[1][0], COLOURS[2][0]],
    G: [0, COLOURS[1][1], COLOURS[2][1]],
    B: [0, COLOURS[1][2], COLOURS[2][2]],
    A: [0, showLiver ? 255 : 0, showTumour ? 255 : 0],
    I: [0, 1, 2],
    labels: ["background", "liver", "tumour"],
  };
}

async function open(name) {
  const index = state.cases.findIndex((c) => c.name === name);
  if (index < 0) return;
  state.current = index;
  state.viewing = true;
  const c = state.cases[index];
  if (location.hash !== `#${encodeURIComponent(name)}`) {
    history.replaceState(null, "", `#${encodeURIComponent(name)}`);
  }
  $("list").hidden = true;
  $("viewer").hidden = false;
  $("scan-name").textContent = c.name;
  const badge = $("scan-verdict");
  badge.textContent = c.verdict || "no verdict";
  badge.className = `verdict ${VERDICT_CLASS[c.verdict] || ""}`;
  const shown = visibleCases();
  $("scan-position").textContent = `${shown.indexOf(c) + 1} of ${shown.length}`;
  showDetails(c);
  showMark(c.name);
  $("reference-toggle").hidden = !"reference" in c.files;
  await showVolumes(c);
}

async function showVolumes(c) {
  const nv = await viewer();
  const volumes = [];
  const scan = "scan" in c.files;
  if (scan) volumes.push({ url: fileUrl(c.name, c.files.scan), colormap: "gray" });
  const labels = $("show-reference").checked && "reference" in c.files ? "reference" : "seg";
  if (labels in c.files) volumes.push({ url: fileUrl(c.name, c.files[labels]), opacity: opacity() });
  if (!volumes.length) {
    $("readout").textContent = "neither the scan nor its labels can be read (see the reasons)";
    return;
  }
  if (!scan) $("readout").textContent = "the scan is not available: its labels alone";
  for (const v of volumes) v.name = v.url.split("/").pop(); // NiiVue reads the format from it
  document.body.dataset.drawn = "";
  try {
    await nv.loadVolumes(volumes);
  } catch (error) {
    $("readout").textContent = `could not show ${c.name}: ${error}`;
    return;
  }
  if (state.cases[state.current] !== c) return; // another scan was opened meanwhile
  state.labelIndex = labels in c.files ? volumes.length - 1 : -1;
  if (state.labelIndex >= 0) applyLabels();
  if (scan) applyWindow(currentWindow());
  applyLayout(currentLayout());
  document.body.dataset.drawn = c.name; // for the tests: this scan is on the canvas
}

function opacity() {
  return Number($("opacity").value);
}

function applyLabels() {
  const nv = state.nv;
  const labels = nv.volumes[state.labelIndex];
  if (!labels) return;
  labels.setColormapLabel(labelColours($("show-liver").checked, $("show-tumour").checked));
  nv.setOpacity(state.labelIndex, opacity());
  nv.updateGLVolume();
}

function currentWindow() {
  return document.querySelector("#windows .on")?.dataset.window || "abdomen";
}

function applyWindow(name) {
  const nv = state.nv;
  const scan = nv?.volumes[0];
  if (!scan || !"scan" in (state.cases[state.current]?.files || {})) return;
  let low;
  let high;
  if (WINDOWS[name]) {
    const [width, level] = WINDOWS[name];
    [low, high] = [level - width / 2, level + width / 2];
  } else {
    [low, high] = [scan.global_min, scan.global_max];
  }
  scan.cal_min = low;
  scan.cal_max = high;
  nv.updateGLVolume();
  $("window-value").textContent = `window ${number(low, 0)} to ${number(high, 0)} HU`;
}

function currentLayout() {
  return document.querySelector("#layouts .on")?.dataset.layout || "grid";
}

function applyLayout(name) {
  const nv = state.nv;
  const types = {
    grid: SLICE_TYPE.MULTIPLANAR,
    axial: SLICE_TYPE.AXIAL,
    coronal: SLICE_TYPE.CORONAL,
    sagittal: SLICE_TYPE.SAGITTAL,
    render: SLICE_TYPE.RENDER,
  };
  nv.setSliceType(types[name]);
}

function choose(groupId, button) {
  for (const b of document.querySelectorAll(`#${groupId} button`)) b.classList.remove("on");
  button.classList.add("on");
}

function hover(nv, event) {
  if (!nv.volumes.length) return;
  try {
    const pos = nv.getNoPaddingNoBorderCanvasRelativeMousePosition(event, nv.gl.canvas);
    const dpr = nv.uiData?.dpr || window.devicePixelRatio || 1;
    const frac = nv.canvasPos2frac([pos.x * dpr, pos.y * dpr]);
    if (frac[0] < 0) return; // not over a slice
    const vox = nv.frac2vox(frac, 0).map((v) => Math.round(v));
    showValues(nv.volumes.map((v) => v.getValue(vox[0], vox[1], vox[2])));
  } catch {
    // outside the slices, or a view (3-D) without voxels under the cursor
  }
}

function showValues(values) {
  if (!values) return;
  const c = state.cases[state.current];
  const scan = c && "scan" in c.files;
  const hu = scan ? values[0] : undefined;
  const label = values[state.labelIndex];
  const name = { 0: "background", 1: "liver", 2: "tumour" }[Math.round(label)] ?? "–";
  $("readout").textContent =
    (hu === undefined ? "" : `HU ${number(hu, 0)} · `) + `label ${name}`;
}

function showDetails(c) {
  const list = $("numbers");
  list.replaceChildren();
  const rows = [
    ["score", c.score, 2, ""],
    ["liver", c.liver_volume_ml, 1, " mL"],
    ["tumour", c.tumour_volume_ml, 1, " mL"],
    ["tumours", c.tumour_count, 0, ""],
    ["largest tumour", c.largest_tumour_diameter_mm, 1, " mm"],
    ["burden", c.tumour_burden_percent, 2, " %"],
    ["Dice liver", c.dice?.liver, 3, ""],
    ["Dice tumour", c.dice?.tumour, 3, ""],
  ];
  for (const [term, value, digits, unit] of rows) {
    if (value !== null && value !== undefined) {
      list.append(element("dt", term), element("dd", number(value, digits) + unit));
    }
  }
  const tumours = $("tumours");
  tumours.replaceChildren();
  c.tumours.forEach((t, index) => {
    const size = t.diameter_mm === null ? "" : `, ${number(t.diameter_mm)} mm`;
    const button = element("button", `tumour ${index + 1}: ${number(t.volume_ml)} mL${size}`);
    button.title = "go to this tumour (t: the next one)";
    button.addEventListener("click", () => goToTumour(index));
    tumours.append(button);
  });
  state.tumour = -1;
  const reasons = $("reasons");
  reasons.replaceChildren();
  for (const r of c.reasons) reasons.append(element("p", r));
  for (const w of c.warnings) reasons.append(element("p", `warning: ${w}`, "warning"));
  for (const p of c.problems) reasons.append(element("p", p, "problem"));
}

function goToTumour(index) {
  const c = state.cases[state.current];
  const nv = state.nv;
  if (!c?.tumours.length || !nv?.volumes.length) return;
  state.tumour = index % c.tumours.length;
  nv.scene.crosshairPos = nv.mm2frac(c.tumours[state.tumour].centre_mm);
  nv.drawScene();
  nv.createOnLocationChange();
  for (const [i, b] of [...$("tumours").children].entries()) b.classList.toggle("on", i === state.tumour);
}

// --- marks ------------------------------------------------------------------------------

function showMark(name) {
  const mark = state.marks[name];
  for (const b of document.querySelectorAll("#marks button")) {
    b.classList.toggle("on", mark?.mark === b.dataset.mark);
  }
  $("comment").value = mark?.comment || "";
  $("mark-status").textContent = mark ? `saved ${mark.at} by ${mark.reviewer}` : "not marked";
}

async function saveMark(name, mark, comment) {
  $("mark-status").textContent = "saving…";
  try {
    const saved = await request(`/api/marks/${encodeURIComponent(name)}`, {
      method: "PUT",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ mark, comment }),
    });
    if (saved.mark) state.marks[name] = saved.mark;
    else delete state.marks[name];
    showError("");
  } catch (error) {
    showError(`the mark of ${name} was not saved: ${error.message}`);
  }
  if (state.cases[state.current]?.name === name) showMark(name);
  renderTable();
}

function markCurrent(mark) {
  const c = state.cases[state.current];
  if (!c) return;
  const now = state.marks[c.name]?.mark;
  const comment = state.viewing ? $("comment").value : state.marks[c.name]?.comment || "";
  saveMark(c.name, now === mark ? null : mark, comment); // the same key again clears it
}

function saveComment() {
  const c = state.cases[state.current];
  if (!c) return;
  const mark = state.marks[c.name];
  if ((mark?.comment || "") !== $("comment").value) {
    saveMark(c.name, mark?.mark || null, $("comment").value);
  }
}

// --- wiring -----------------------------------------------------------------------------

function backToList() {
  state.viewing = false;
  $("viewer").hidden = true;
  $("list").hidden = false;
  history.replaceState(null, "", location.pathname);
  highlight();
}

function onKey(event) {
  if (event.target.closest("textarea, input, select") || event.ctrlKey || event.metaKey) return;
  const key = event.key;
  if (key === "j" || (key === "ArrowDown" && !state.viewing)) step(1);
  else if (key === "k" || (key === "ArrowUp" && !state.viewing)) step(-1);
  else if (key === "Enter" && !state.viewing && state.current >= 0) open(state.cases[state.current].name);
  else if (key === "Escape" && state.viewing) backToList();
  else if (MARK_KEYS[key]) markCurrent(MARK_KEYS[key]);
  else if (key === "t" && state.viewing) goToTumour(state.tumour + 1);
  else return;
  event.preventDefault();
}

function wire() {
  $("filter-verdict").addEventListener("change", renderTable);
  $("filter-mark").addEventListener("change", renderTable);
  $("back").addEventListener("click", backToList);
  $("previous").addEventListener("click", () => step(-1));
  $("next").addEventListener("click", () => step(1));
  for (const b of document.querySelectorAll("#marks button")) {
    b.addEventListener("click", () => markCurrent(b.dataset.mark));
  }
  for (const b of document.querySelectorAll("#layouts button")) {
    b.addEventListener("click", () => { choose("layouts", b); applyLayout(b.dataset.layout); });
  }
  for (const b of document.querySelectorAll("#windows button")) {
    b.addEventListener("click", () => { choose("windows", b); applyWindow(b.dataset.window); });
  }
  $("opacity").addEventListener("input", applyLabels);
  $("show-liver").addEventListener("change", applyLabels);
  $("show-tumour").addEventListener("change", applyLabels);
  $("show-reference").addEventListener("change", () => showVolumes(state.cases[state.current]));
  $("comment").addEventListener("blur", saveComment);
  $("comment").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) saveComment();
  });
  document.addEventListener("keydown", onKey);
  // Another tab's marks: fetched again whenever this one comes back to the front.
  window.addEventListener("focus", async () => {
    try {
      await loadBatch();
      if (state.viewing) showMark(state.cases[state.current].name);
    } catch (error) {
      showError(error.message);
    }
  });
}

async function start() {
  wire();
  try {
    await loadBatch();
  } catch (error) {
    showError(`the batch could not be read: ${error.message}`);
    return;
  }
  // The link's token is in the cookie now: the address bar keeps no secret.
  const hash = decodeURIComponent(location.hash.slice(1));
  history.replaceState(null, "", location.pathname + location.hash);
  if (hash) await open(hash);
  else step(0);
  document.body.dataset.ready = "true";
}

start();
