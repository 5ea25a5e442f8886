// accelstack portal: one page, hash routes, everything through the REST API with the caller's bearer token.
// The token lives in sessionStorage only (gone when the tab closes) and travels as the Authorization header;
// it is never put in a URL, a cookie or a log. The DOM is built with textContent only (no HTML from data).
"use strict";

const TOKEN_KEY = "accelstack.token";
const PAGE = 50;
let me = null; // whoami: {user, allowed: {...}}

// ---- small helpers ------------------------------------------------------------------------------------
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

function main() { return document.getElementById("main"); }
function show(...nodes) { main().replaceChildren(...nodes.flat(Infinity).filter((n) => n !== null && n !== undefined && n !== false)); }
function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }
function enc(s) { return encodeURIComponent(s); }

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, opts = {}) {
  const headers = { "Authorization": "Bearer " + token(), "Accept": "application/json" };
  if (opts.body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(path, {
    method: opts.method || "GET", headers, cache: "no-store",
    body: opts.body !== undefined ? JSON.stringify(opts.body) : undefined,
  });
  let data = null;
  try { data = await res.json(); } catch (e) { data = null; }
  if (!res.ok) {
    if (res.status === 401) { sessionStorage.removeItem(TOKEN_KEY); me = null; }
    throw new ApiError(res.status, (data && data.error) || res.statusText);
  }
  return data;
}

function when(ts) {
  if (!ts) return "—";
  const s = Math.round((Date.parse(ts) - Date.now()) / 1000);
  return relative(s);
}

function relative(s) {
  if (s === null || s === undefined) return "—";
  const a = Math.abs(s);
  const text = a < 60 ? a + "s" : a < 3600 ? Math.round(a / 60) + "m" : a < 86400 ? (a / 3600).toFixed(1) + "h"
    : (a / 86400).toFixed(1) + "d";
  return Math.abs(s) < 5 ? "now" : s > 0 ? "in " + text : text + " ago";
}

function age(seconds) { return seconds === null || seconds === undefined ? "—" : relative(-seconds).replace(" ago", ""); }

function refusal(err, what) {
  if (err instanceof ApiError && (err.status === 403 || err.status === 401)) {
    return h("div", { class: "refusal", role: "alert" },
      h("strong", {}, "Not allowed. "), err.message,
      h("p", {}, "Your RBAC does not allow " + what + ". Ask a platform admin for a role that does."));
  }
  return h("div", { class: "error", role: "alert" }, h("strong", {}, "Error: "), err.message || String(err));
}

function table(headers, rows, cls) {
  return h("table", { class: cls || "" },
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, r.map((c) => h("td", {}, c))))));
}

function heat(used, capacity) {
  if (!capacity) return "heat-na";
  const f = used / capacity;
  return "heat-" + Math.min(5, Math.floor(f * 5 + (f > 0 ? 0.999 : 0)));
}

function params(q) { return new URLSearchParams(q || ""); }

function notAllowed(ability, what) {
  return me && me.allowed && me.allowed[ability] === false
    ? refusal(new ApiError(403, (me.user || "you") + " may not " + what), what) : null;
}

// ---- login ----------------------------------------------------------------------------------------------
// Nobody is signed in in this tab: the header forgets the last caller (after a failed login it still said
// "signed in as alice" above the refusal) and the menu shows nothing until the next whoami.
function signedOut() {
  me = null;
  document.getElementById("who").textContent = "";
  document.getElementById("logout").hidden = true;
  for (const a of document.querySelectorAll("#nav a")) a.hidden = true;
}

// The login form; drawing it signs the tab out (every way to it: no token, a refused one, a 401, log out).
function loginPage(message) {
  signedOut();
  const input = h("input", { id: "token", type: "password", autocomplete: "off", required: true,
    placeholder: "a service-account or OIDC token", size: 60 });
  const form = h("form", { id: "login", class: "card", onsubmit: async (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    input.value = "";
    try {
      await loadMe();
      if (location.hash === "#/inventory") route();
      else location.hash = "#/inventory";
    } catch (err) {
      sessionStorage.removeItem(TOKEN_KEY);
      show(loginPage(err.message));
    }
  } },
  h("h1", {}, "Log in"),
  h("p", {}, "Paste a bearer token. The API server checks it (TokenReview) and your RBAC decides what you see. "
    + "It is kept in this tab only."),
  h("label", { for: "token" }, "Token "), input, " ", h("button", { type: "submit", id: "login-submit" }, "Log in"),
  message ? h("p", { class: "error", role: "alert", id: "login-error" }, message) : null);
  return form;
}

async function loadMe() {
  me = await api("/api/v1/whoami");
  document.getElementById("who").textContent = me.user ? "signed in as " + me.user : "";
  document.getElementById("logout").hidden = false;
  for (const a of document.querySelectorAll("#nav a")) {
    // a hub (accelstack-hub --api-listen) serves the inventory and the queue over every member, nothing else
    a.hidden = me.allowed[a.dataset.needs] === false
      || (me.hub === true && !["#/inventory", "#/queue"].includes(a.getAttribute("href")));
  }
}

// ---- inventory ------------------------------------------------------------------------------------------
async function inventoryPage(ctx) {
  const refused = notAllowed("inventory", "list nodes (the inventory)");
  if (refused) return ctx.show(h("h1", {}, "Inventory"), refused);
  const s = await api("/api/v1/inventory?summary=1");
  if (s.hub) return hubInventory(ctx, s);
  const t = s.totals;
  const byKey = new Map(s.cells.map((c) => [c.resource + "\u0000" + c.model + "\u0000" + c.group, c]));
  const head = ["Model \\ " + s.groupLabel, ...s.groups];
  const rows = s.models.map(([resource, model]) => [
    h("span", {}, h("strong", {}, model), h("br"), h("small", {}, resource)),
    ...s.groups.map((g) => {
      const c = byKey.get(resource + "\u0000" + model + "\u0000" + g);
      if (!c) return h("span", { class: "cell heat-na" }, "");
      const used = c.held;  // allocated or reserved, each device once
      const href = "#/inventory/group/" + enc(g) + "?" + params({ resource, model }).toString();
      return h("a", { class: "cell " + heat(used, c.capacity) + (c.unhealthyNodes ? " sick" : ""), href,
        title: `${c.nodes} nodes, ${c.capacity} devices: ${c.allocated} allocated, ${c.reserved} reserved, `
          + `${c.free} free, ${c.unhealthyNodes} unhealthy nodes` },
      `${used}/${c.capacity}`, c.unhealthyNodes ? h("small", {}, ` ⚠${c.unhealthyNodes}`) : null);
    })]);
  ctx.show(h("h1", {}, "Inventory"),
    h("p", { class: "totals", id: "totals" },
      `${t.nodes} nodes · ${t.capacity} devices · ${t.allocated} allocated · ${t.reserved} reserved · `
      + `${t.free} free · ${t.unhealthyNodes} unhealthy nodes`),
    h("p", {}, "Each cell: devices allocated or reserved / devices, for one model in one node group. "
      + "Colour: share in use. Select a cell for its nodes."),
    table(head, rows, "heatmap"), legend());
}

// A hub's inventory: cluster → model → node group, each member's state beside its rows (its last report when
// Lost). The members report per model, not per node group: the group column says so.
function hubInventory(ctx, s) {
  const t = s.totals;
  const state = new Map(s.clusters.map((m) => [m.cluster, m]));
  let last = "";
  const rows = s.cells.map((c) => {
    const m = state.get(c.cluster) || {};
    const first = c.cluster !== last;
    last = c.cluster;
    return [first ? h("strong", {}, c.cluster) : "",
      first ? h("span", { class: "phase " + (m.ready ? "Running" : "Failed") }, m.ready ? "Ready" : m.lost ? "Lost" : "not Ready") : "",
      h("span", {}, h("strong", {}, c.model), h("br"), h("small", {}, c.resource)), c.group,
      h("span", { class: "cell " + heat(c.allocated + c.reserved, c.capacity) }, `${c.allocated + c.reserved}/${c.capacity}`),
      c.free, c.unhealthy, c.queued];
  });
  ctx.show(h("h1", {}, "Inventory of every cluster"),
    h("p", { class: "totals", id: "totals" },
      `${s.clusters.length} clusters · ${t.capacity} devices · ${t.allocated} allocated · ${t.reserved} reserved · `
      + `${t.free} free · ${t.queued} queued`),
    h("p", { class: "hint" }, "Each member's devices as its agent last reported them: allocated or reserved / "
      + "devices per model. " + s.groupLabel + "."),
    table(["Cluster", "State", "Model", "Node group", "In use", "Free", "Unhealthy", "Queued"], rows, "hub-inventory"));
}

function legend() {
  return h("p", { class: "legend" }, "in use: ", ["0%", "≤20%", "≤40%", "≤60%", "≤80%", "≤100%"].map(
    (label, i) => h("span", { class: "cell heat-" + i }, label)), h("span", { class: "cell sick" }, "⚠ unhealthy"));
}

async function groupPage(ctx, group, q) {
  const p = params(q);
  const g = await api("/api/v1/inventory/groups/" + enc(group) + "?" + p.toString());
  const tiles = g.nodes.map((n) => h("a", {
    class: "tile " + heat(n.held, n.capacity) + (n.healthy ? "" : " sick"),
    href: "#/node/" + enc(n.node),
    title: `${n.node}: ${n.allocated} allocated, ${n.reserved} reserved, ${n.free} free of ${n.capacity}`
      + (n.reason ? ` — ${n.reason}` : ""),
  }, h("span", {}, n.node), h("small", {}, `${n.held}/${n.capacity}`)));
  ctx.show(h("p", {}, h("a", { href: "#/inventory" }, "← Inventory")),
    h("h1", {}, `Node group ${group}`),
    h("p", {}, `${g.groupLabel}=${group}` + (p.get("model") ? ` · ${p.get("model")}` : "") + ` · ${g.nodes.length} nodes`),
    h("div", { class: "tiles", id: "tiles" }, tiles), legend());
}

async function nodePage(ctx, name) {
  const n = await api("/api/v1/inventory/nodes/" + enc(name));
  ctx.show(h("p", {}, h("a", { href: "#/inventory/group/" + enc(n.group) }, "← " + n.group)),
    h("h1", {}, "Node " + n.node),
    h("h2", {}, "Devices"),
    table(["Resource", "Model", "Capacity", "Allocatable", "Allocated", "Reserved", "Free", "Health"],
      n.resources.map((r) => [r.resource, r.model, r.capacity, r.allocatable, r.allocated, r.reserved, r.free,
        r.healthy ? "healthy" : h("span", { class: "bad" }, r.reason)])),
    n.health.length ? h("h2", {}, "Health") : null,
    n.health.length ? table(["Resource", "Problem", "Since"],
      n.health.map((x) => [x.resource, x.reason, x.since ? when(x.since) : "—"])) : null,
    h("h2", {}, "Pods holding devices"),
    n.holders.length ? table(["Pod", "GPR", "Resource", "Devices", "Phase"],
      n.holders.map((x) => [x.pod, x.gpr ? gprLink(x.gpr) : "—", x.resource, x.devices, x.phase]))
      : h("p", {}, "none"),
    h("h2", {}, "Reservations"),
    n.reservations.length ? table(["GPR", "Phase", "Devices", "In use"],
      n.reservations.map((x) => [gprLink(x.gpr), x.phase, x.devices, x.inUse])) : h("p", {}, "none"),
    h("details", {}, h("summary", {}, "Labels"),
      table(["Label", "Value"], Object.entries(n.labels).sort().map(([k, v]) => [k, v]))));
}

function gprLink(key) {
  const [ns, name] = key.split("/");
  return h("a", { href: "#/gpr/" + enc(ns) + "/" + enc(name) }, key);
}

// ---- queue ----------------------------------------------------------------------------------------------
async function queuePage(ctx, q) {
  const refused = notAllowed("queue", "list GPRs cluster-wide (filter by a namespace you may read)");
  const p = params(q);
  // A member who may not list GPRs cluster-wide starts at its first workspace's queue (whoami.workspaces).
  if (!p.get("namespace") && !p.get("workspace") && me && me.workspaces && me.workspaces.length) {
    p.set("workspace", me.workspaces[0].name);
  }
  const field = (name, label, options) => {
    const value = p.get(name) || "";
    const el = options
      ? h("select", { name, id: "f-" + name }, options.map(([v, t]) => h("option", { value: v, selected: v === value }, t)))
      : h("input", { name, id: "f-" + name, value, size: 14 });
    return h("label", {}, label + " ", el);
  };
  const form = h("form", { class: "filters", id: "queue-filters", onsubmit: (ev) => {
    ev.preventDefault();
    const next = new URLSearchParams();
    for (const el of ev.target.elements) if (el.name && el.value) next.set(el.name, el.value);
    location.hash = "#/queue?" + next.toString();
  } },
  field("namespace", "Namespace"), me && me.hub ? field("cluster", "Cluster") : field("workspace", "Workspace"),
  field("phase", "Phase", [["", "unfinished"], ["Queued", "Queued"], ["Admitted,Running", "holding"],
    ["all", "all"]]),
  field("resource", "Resource", [["", "any"], ["nvidia.com/gpu", "nvidia.com/gpu"],
    ["neureality.com/nr1", "neureality.com/nr1"]]),
  h("button", { type: "submit" }, "Filter"));
  if (refused && !p.get("namespace") && !p.get("workspace")) return ctx.show(h("h1", {}, "Queue"), form, refused);
  const query = new URLSearchParams(p);
  query.set("limit", String(PAGE));
  const data = await api("/api/v1/queue?" + query.toString()).catch((err) => err);
  if (data instanceof Error) return ctx.show(h("h1", {}, "Queue"), form, refusal(data, "list these GPRs"));
  const counts = Object.entries(data.counts).sort().map(([k, v]) => `${v} ${k}`).join(" · ");
  if (data.hub) {  // a hub: every member's GPRs, the cluster first (none yet: not placed)
    return ctx.show(h("h1", {}, "Queue of every cluster"), form,
      h("p", { id: "queue-counts" }, `${data.total} match the filter · by phase: ${counts || "no GPRs"}`),
      h("p", { id: "queue-order", class: "hint" }, data.order),
      table(["Cluster", "Pos", "GPR", "Phase", "Devices", "Estimated start", "Age", "Reason"], data.items.map((r) => [
        r.cluster || "(not placed)", r.position ?? "—", r.namespace + "/" + r.name,
        h("span", { class: "phase " + r.phase }, r.phase), `${r.devicesPerNode}×${r.nodeCount} ${r.resource.split("/")[1]}`,
        r.phase === "Queued" ? when(r.estimatedStart) : "—", age(r.ageSeconds), r.reason || ""]), "queue"));
  }
  const rows = data.items.map((r) => [
    r.position ?? "—", h("a", { href: "#/gpr/" + enc(r.namespace) + "/" + enc(r.name) }, r.namespace + "/" + r.name),
    r.workspace, h("span", { class: "phase " + r.phase }, r.phase), r.level ? `${r.priority} (${r.level})` : r.priority,
    `${r.devicesPerNode}×${r.nodeCount} ${r.resource.split("/")[1]}`,
    r.phase === "Queued" ? when(r.estimatedStart) : "—", age(r.ageSeconds), r.reason || ""]);
  const offset = Number(p.get("continue") || 0);
  const pager = (label, off) => {
    const next = new URLSearchParams(p);
    next.set("continue", String(off));
    return h("a", { class: "button", href: "#/queue?" + next.toString() }, label);
  };
  ctx.show(h("h1", {}, "Queue"), form,
    h("p", { id: "queue-counts" }, `${data.total} match the filter · by phase: ${counts || "no GPRs"}`),
    data.order ? h("p", { id: "queue-order", class: "hint" }, data.order) : null,
    table(["Pos", "GPR", "Workspace", "Phase", "Priority", "Devices", "Estimated start", "Age", "Reason"], rows,
      "queue"),
    h("p", { class: "pager" }, offset > 0 ? pager("← previous", Math.max(0, offset - PAGE)) : null, " ",
      data.continue ? pager("next →", Number(data.continue)) : null,
      ` ${data.items.length ? offset + 1 : 0}–${offset + data.items.length} of ${data.total}`));
}

// ---- a GPR ------------------------------------------------------------------------------------------------
async function gprPage(ctx, ns, name) {
  const [obj, events] = await Promise.all([
    api(`/api/v1/gprs/${enc(ns)}/${enc(name)}`),
    api(`/api/v1/gprs/${enc(ns)}/${enc(name)}/events`).catch((err) => err)]);
  const st = obj.status || {};
  const spec = obj.spec || {};
  const facts = [["Phase", h("span", { class: "phase " + (st.phase || "Queued") }, st.phase || "Queued")],
    ["Reason", st.reason || "—"], ["Message", st.message || "—"]];
  if ((st.phase || "Queued") === "Queued") {
    facts.push(["Queue position", st.queuePosition ?? "—"], ["Estimated start", st.estimatedStart
      ? `${when(st.estimatedStart)} (${st.estimatedStart})` : "no estimate yet"]);
    if (st.estimatedStartRange) {
      facts.push(["Likely between", `${when(st.estimatedStartRange.earliest)} and ${when(st.estimatedStartRange.latest)}`]);
    }
    if (st.nextRetryTime) facts.push(["Next retry", when(st.nextRetryTime)]);
  }
  for (const k of ["admittedAt", "startedAt", "finishedAt"]) if (st[k]) facts.push([k, `${when(st[k])} (${st[k]})`]);
  ctx.show(h("p", {}, h("a", { href: "#/queue" }, "← Queue")),
    h("h1", {}, `GPR ${ns}/${name}`),
    h("dl", { class: "facts", id: "gpr-facts" }, facts.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])),
    h("h2", {}, "Spec"),
    table(["Field", "Value"], Object.entries(spec).map(([k, v]) => [k, typeof v === "object" ? JSON.stringify(v) : String(v)])),
    h("h2", {}, "Reservation"),
    (st.reservation || []).length ? table(["Node", "Devices"],
      st.reservation.map((r) => [h("a", { href: "#/node/" + enc(r.node) }, r.node), r.devices])) : h("p", {}, "none"),
    h("h2", {}, "Conditions"),
    table(["Type", "Status", "Reason", "Message", "Since"], (st.conditions || []).map((c) => [
      c.type, c.status, c.reason || "", c.message || "", when(c.lastTransitionTime)]), "conditions"),
    h("h2", {}, "Events"),
    events instanceof Error ? refusal(events, "list Events in " + ns)
      : events.items.length ? table(["Type", "Reason", "Message", "Count", "Last seen"],
        events.items.map((e) => [e.type, e.reason, e.message, e.count, when(e.lastTimestamp)]), "events")
        : h("p", {}, "none"));
}

// ---- create a GPR from a template, with a live estimate -------------------------------------------------
const EDITABLE = [["devicesPerNode", "Devices per node", "number", "1"], ["nodeCount", "Nodes", "number", "1"],
  ["priority", "Priority", "number", "100"], ["exitDuration", "Exit duration", "text", "e.g. 2h"]];

async function createPage(ctx, q) {
  const refused = notAllowed("createGPR", "create GPRs");
  const p = params(q);
  // A workspace member may create only in its workspaces' namespaces: whoami lists them (createGPRIn).
  const mineNs = (me && me.createGPRIn) || [];
  const nsInput = h("input", { id: "c-namespace", value: p.get("namespace") || mineNs[0] || "default", size: 16,
    list: "c-namespaces" });
  const nsChoices = h("datalist", { id: "c-namespaces" }, mineNs.map((n) => h("option", { value: n })));
  const nameInput = h("input", { id: "c-name", size: 24, required: true, placeholder: "my-training-run" });
  const templateSelect = h("select", { id: "c-template" }, h("option", { value: "" }, "(none)"));
  const inputs = Object.fromEntries(EDITABLE.map(([k, , type, hint]) => [k, h("input", { id: "c-" + k, type, size: 10,
    placeholder: hint })]));
  const estimate = h("div", { id: "estimate", class: "estimate", "aria-live": "polite" }, "—");
  const result = h("div", { id: "create-result" });
  let templates = [];
  let timer = 0;

  function spec() {
    const t = templates.find((x) => x.metadata.name === templateSelect.value);
    const out = Object.assign({}, t ? t.spec : {});
    delete out.description;
    for (const [k, , type] of EDITABLE) {
      const v = inputs[k].value.trim();
      if (v !== "") out[k] = type === "number" ? Number(v) : v;
    }
    return out;
  }

  async function refreshEstimate() {
    try {
      const w = await api("/api/v1/waittime", { method: "POST", body: { namespace: nsInput.value.trim(), spec: spec() } });
      estimate.replaceChildren(
        h("strong", {}, w.estimable ? (w.waitSeconds <= 1 ? "Starts now" : "Starts " + when(w.estimatedStart)) : "No estimate"),
        ` · queue position ${w.queuePosition} · ${w.basis}`,
        w.estimatedStartRange && w.waitSeconds > 1
          ? ` · likely ${when(w.estimatedStartRange.earliest)} – ${when(w.estimatedStartRange.latest)}` : "");
    } catch (err) {
      estimate.replaceChildren(refusal(err, "estimate wait times in this namespace"));
    }
  }
  const later = () => { clearTimeout(timer); timer = setTimeout(refreshEstimate, 250); };

  async function loadTemplates() {
    templateSelect.replaceChildren(h("option", { value: "" }, "(none)"));
    try {
      templates = (await api("/api/v1/templates?namespace=" + enc(nsInput.value.trim()))).items;
    } catch (err) { templates = []; }
    for (const t of templates) {
      templateSelect.append(h("option", { value: t.metadata.name }, t.metadata.name
        + (t.spec.description ? " — " + t.spec.description : "")));
    }
    if (p.get("template")) templateSelect.value = p.get("template");
    fillFromTemplate();
  }
  function fillFromTemplate() {
    const t = templates.find((x) => x.metadata.name === templateSelect.value);
    for (const [k] of EDITABLE) inputs[k].value = t && t.spec[k] !== undefined ? t.spec[k] : "";
    later();
  }
  nsInput.addEventListener("change", loadTemplates);
  templateSelect.addEventListener("change", fillFromTemplate);
  for (const el of Object.values(inputs)) el.addEventListener("input", later);

  const form = h("form", { id: "create", class: "card", onsubmit: async (ev) => {
    ev.preventDefault();
    try {
      const made = await api("/api/v1/gprs", { method: "POST",
        body: { namespace: nsInput.value.trim(), name: nameInput.value.trim(), spec: spec() } });
      location.hash = "#/gpr/" + enc(made.metadata.namespace) + "/" + enc(made.metadata.name);
    } catch (err) {
      result.replaceChildren(refusal(err, "create GPRs in " + nsInput.value));
    }
  } },
  h("p", {}, h("label", {}, "Namespace ", nsInput), nsChoices, " ", h("label", {}, "Template ", templateSelect)),
  mineNs.length ? h("p", { id: "create-where" }, "You may create GPRs in: " + mineNs.join(", ")) : null,
  h("p", {}, h("label", {}, "Name ", nameInput)),
  h("p", {}, EDITABLE.map(([k, label]) => h("label", {}, label + " ", inputs[k], " "))),
  h("h2", {}, "Estimated start if submitted now"), estimate,
  h("p", {}, h("button", { type: "submit", id: "create-submit" }, "Create GPR")), result);
  ctx.show(h("h1", {}, "Create a GPR"), refused, form);
  await loadTemplates();
}

// ---- workspaces -------------------------------------------------------------------------------------------
async function workspacesPage(ctx) {
  const refused = notAllowed("workspaces", "list workspaces");
  if (refused) return ctx.show(h("h1", {}, "Workspaces"), refused);
  const [ws, bindings] = await Promise.all([api("/api/v1/workspaces"),
    api("/api/v1/templatebindings").catch((err) => err)]);
  // Each workspace's unfinished GPRs with their reasons, one queue call per namespace the caller may read (a
  // member's roles are per namespace, so a workspace-wide query could be refused for one of them).
  const waiting = await Promise.all(ws.items.map((w) => Promise.all(((w.status || {}).namespaces
    || ((w.spec || {}).namespaces || []).map((n) => ({ name: n }))).map((n) =>
    api("/api/v1/queue?namespace=" + enc(n.name)).then((q) => q.items).catch(() => []))).then((parts) => parts.flat())));
  const cards = ws.items.map((w, wi) => {
    const st = w.status || {};
    const spec = w.spec || {};
    const mine = bindings instanceof Error ? [] : bindings.items.filter((b) => b.spec.workspace === w.metadata.name
      || (b.spec.namespaces || []).some((n) => (spec.namespaces || []).includes(n)));
    const ready = (st.conditions || []).find((c) => c.type === "Ready");
    return h("section", { class: "card workspace", id: "ws-" + w.metadata.name },
      h("h2", {}, w.metadata.name, " ", ready ? h("span", { class: ready.status === "True" ? "ok" : "bad" },
        ready.status === "True" ? "Ready" : "Not ready: " + (ready.message || ready.reason)) : null),
      h("p", {}, "Namespaces: ", (st.namespaces || (spec.namespaces || []).map((n) => ({ name: n })))
        .map((n) => n.name + (n.adopted ? " (adopted)" : "")).join(", ") || "—"),
      h("p", {}, "GPRs: ", st.gprs ? `${st.gprs.queued || 0} queued · ${st.gprs.admitted || 0} admitted · `
        + `${st.gprs.running || 0} running` : "—"),
      h("h3", {}, "Devices against quota"),
      (st.usage || []).length ? table(["Resource", "Model", "In use", "Reserved", "Queued", "Quota", ""],
        st.usage.map((u) => [u.resource, u.model || "any", u.inUse, u.reserved, u.queued, u.max ?? "—",
          bar(u.inUse + u.reserved, u.max)]), "usage") : h("p", {}, "no device quota"),
      h("h3", {}, "Queue ", h("a", { href: "#/queue?workspace=" + enc(w.metadata.name) }, "(open)")),
      waiting[wi].length ? table(["Pos", "GPR", "Phase", "Devices", "Estimated start", "Reason"], waiting[wi].map((r) => [
        r.position ?? "—", h("a", { href: "#/gpr/" + enc(r.namespace) + "/" + enc(r.name) }, r.namespace + "/" + r.name),
        r.phase, `${r.nodeCount}×${r.devicesPerNode}`, when(r.estimatedStart), r.reason || ""]), "ws-queue")
        : h("p", {}, "no unfinished GPRs you may read"),
      h("h3", {}, "Members"),
      table(["Kind", "Name", "Role"], (st.members || spec.access || []).map((m) => [m.kind, m.name, m.role])),
      h("h3", {}, "Template bindings"),
      bindings instanceof Error ? refusal(bindings, "list template bindings")
        : mine.length ? table(["Binding", "Template", "Applies to", "Weight"], mine.map((b) => [
          b.metadata.namespace + "/" + b.metadata.name, b.spec.template,
          b.spec.workloadSelector ? "workloads " + JSON.stringify(b.spec.workloadSelector.matchLabels || b.spec.workloadSelector)
            : b.spec.namespaces ? "namespaces " + b.spec.namespaces.join(", ") : "workspace " + (b.spec.workspace || ""),
          b.spec.weight || 0])) : h("p", {}, "none"),
      spec.defaultTemplate ? h("p", {}, `Default template: ${spec.defaultTemplate.namespace}/${spec.defaultTemplate.name}`) : null);
  });
  ctx.show(h("h1", {}, "Workspaces"), cards.length ? cards : h("p", {}, "No workspaces yet."));
}

function bar(used, max) {
  if (!max) return "";
  const pct = Math.min(100, Math.round((100 * used) / max));
  const el = h("meter", { min: 0, max, value: Math.min(used, max), high: Math.ceil(max * 0.8), optimum: 0,
    title: `${pct}% of quota` });
  return h("span", {}, el, ` ${pct}%`);
}

// ---- health -----------------------------------------------------------------------------------------------
async function healthPage(ctx) {
  const refused = notAllowed("inventory", "list nodes (node health)");
  if (refused) return ctx.show(h("h1", {}, "Health"), refused);
  const hl = await api("/api/v1/health");
  ctx.show(h("h1", {}, "Health"),
    h("p", { id: "health-summary" }, `${hl.unhealthyNodes} of ${hl.totalNodes} nodes have a problem · `
      + `${hl.unhealthyDevices} devices out of service`),
    hl.nodes.length ? table(["Node", "Group", "Models", "Devices out", "Since", "Problems"], hl.nodes.map((n) => [
      h("a", { href: "#/node/" + enc(n.node) }, n.node), n.group, n.models.join(", "), n.unhealthyDevices,
      n.since ? when(n.since) : "—",
      h("ul", {}, n.problems.map((x) => h("li", {}, `${x.resource}: ${x.reason}` + (x.since ? ` (since ${x.since})` : ""))))]),
    "health") : h("p", {}, "Every node is healthy."));
}

// ---- router -------------------------------------------------------------------------------------------------
let routed = 0; // the latest navigation: a slower, older one must not draw over it

async function route() {
  const [path, q] = (location.hash.replace(/^#\/?/, "") || "inventory").split("?");
  const parts = path.split("/").map(decodeURIComponent);
  const mine = ++routed;
  const ctx = { show: (...nodes) => { if (mine === routed) show(...nodes); } };
  if (!token()) {
    show(loginPage());
    main().dataset.page = "login";
    main().setAttribute("aria-busy", "false"); // an older navigation still under way no longer counts
    return;
  }
  const page = parts[0] === "login" ? "inventory" : parts[0];
  try {
    main().setAttribute("aria-busy", "true");
    if (!me) await loadMe();
    if (parts[0] === "inventory" && parts[1] === "group") await groupPage(ctx, parts[2], q);
    else if (page === "inventory") await inventoryPage(ctx);
    else if (page === "node") await nodePage(ctx, parts[1]);
    else if (page === "queue") await queuePage(ctx, q);
    else if (page === "gpr") await gprPage(ctx, parts[1], parts[2]);
    else if (page === "create") await createPage(ctx, q);
    else if (page === "workspaces") await workspacesPage(ctx);
    else if (page === "health") await healthPage(ctx);
    else ctx.show(h("h1", {}, "Not found"), h("p", {}, "No page " + path));
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) return ctx.show(loginPage(err.message));
    ctx.show(h("h1", {}, "accelstack"), refusal(err, "this page"));
  } finally {
    if (mine === routed) {
      main().dataset.page = page;
      main().setAttribute("aria-busy", "false");
    }
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("logout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    location.hash = "#/login";
    show(loginPage());
  });
  window.addEventListener("hashchange", route);
  route();
});
