// taskledger dashboard: a snapshot, then the live SSE feed (GET /stream).
//
// Order matters and is what makes it gapless: read the log's head first, then
// the views (tasks, jobs, blockers), then follow /stream from that head. The
// views may already include some later changes; the events after the head
// replay them, which only refreshes views again. Every event is applied once:
// the feed is deduplicated by seq (EventSource resumes with Last-Event-ID after
// a dropped connection, and when the browser gives up we reopen it ourselves
// from the last seq seen). Views are refreshed from the API, never guessed:
// an event only says which task or job to re-read.
//
// Time travel never folds in the browser either: the board as of a seq comes
// from GET /dashboard/tasks?as_of_seq=, a task page from GET /tasks/{id}?as_of_seq=.
// The live snapshot keeps following the stream meanwhile, so "Live" is instant.
//
// Routes live in the URL's fragment: `#/?project=&label=&assignee=&state=&q=&verify=1&as_of=N`
// (the board, its filters and the seq it shows) and `#/tasks/{id}?as_of=N` (a task page).
//
// Plain DOM, no library. Every value from the service goes in as text, never
// as markup.
(() => {
  'use strict';

  const $ = (id) => document.getElementById(id);

  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    if (attrs) {
      for (const [k, v] of Object.entries(attrs)) {
        if (v === null || v === undefined || v === false) continue;
        if (k === 'class') el.className = v;
        else if (k === 'onclick') el.addEventListener('click', v);
        else if (k === 'onsubmit') el.addEventListener('submit', v);
        else if (k === 'dataset') Object.assign(el.dataset, v);
        else if (k === 'style') el.style.cssText = v;
        else el.setAttribute(k, v === true ? '' : String(v));
      }
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false) continue;
      el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return el;
  }

  const COLUMNS = [
    ['pending', 'Pending', ['pending']],
    ['running', 'Claimed / running', ['claimed', 'running']],
    ['verifying', 'Verifying', ['verifying']],
    ['verified', 'Verified', ['verified']],
    ['blocked', 'Rejected / blocked', ['rejected', 'blocked']],
    ['rounds', 'Rounds in progress', ['in_progress', 'round_review']],
    ['done', 'Completed / done', ['completed', 'collected', 'done']],
    ['failed', 'Failed / cancelled', ['failed', 'deadletter', 'cancelled']],
  ];
  const COLUMN_OF = new Map();
  for (const [key, , states] of COLUMNS) for (const s of states) COLUMN_OF.set(s, key);
  const ALL_STATES = COLUMNS.flatMap(([, , states]) => states);
  const TERMINAL = new Set(['verified', 'completed', 'collected', 'done', 'failed', 'deadletter', 'cancelled']);

  const FEED_MAX = 300;
  const PAGE = 1000;
  const COLUMN_PAGE = 50;   // cards drawn per column before "show more"
  const FILTER_KEYS = ['q', 'project', 'label', 'assignee', 'state'];

  const S = {
    session: null,
    tasks: new Map(),
    jobs: new Map(),
    blockers: [],
    lastSeq: 0,       // the last seq applied: the dedupe and resume cursor
    headAtLoad: 0,
    received: 0,      // live events applied
    duplicates: 0,    // events dropped as already seen
    es: null,
    reconnectTimer: null,
    reconnectDelay: 1000,
    renewTimer: null,
    statusTimer: null,
    pendingTasks: new Set(),
    pendingJobs: new Set(),
    blockersDirty: false,
    flushTimer: null,
    changed: new Set(),
    route: { name: 'board', id: null, params: new URLSearchParams() },
    boardHash: '#/',
    asOf: null,       // null: live; else the seq shown
    past: null,       // {seq, tasks: Map, blockers} as of S.asOf
    pastGen: 0,
    page: null,       // the task page: {taskId, events, blockers, asOfView, loaded, error, active, message}
    colLimit: new Map(),
    status: null,
    verify: null,
    generation: 0,    // bumps on sign-out so late answers are dropped
  };
  // Read-only counters for tests and curious people.
  window.taskledgerDashboard = {
    get lastSeq() { return S.lastSeq; },
    get headAtLoad() { return S.headAtLoad; },
    get received() { return S.received; },
    get duplicates() { return S.duplicates; },
    get connected() { return !!S.es && S.es.readyState === 1; },
    get asOf() { return S.asOf; },
    get shownAsOf() { return S.asOf === null ? null : (S.past ? S.past.seq : undefined); },
  };

  class Unauthorized extends Error {}
  class Refused extends Error {
    constructor(status, body) { super(body.detail || body.title || String(status)); this.status = status; this.body = body; }
  }

  async function api(path, opts = {}) {
    const r = await fetch(path, {
      credentials: 'same-origin',
      cache: 'no-store',
      ...opts,
      headers: { Accept: 'application/json', ...(opts.headers || {}) },
    });
    if (r.status === 401) throw new Unauthorized(await detail(r));
    if (!r.ok) {
      let body = {};
      try { body = await r.json(); } catch { body = { detail: r.statusText }; }
      throw new Refused(r.status, body);
    }
    return r.status === 204 ? null : r.json();
  }

  async function detail(r) {
    try { const b = await r.json(); return b.detail || b.title || r.statusText; } catch { return r.statusText; }
  }

  // A write from this session: the cookie plus the session's CSRF token.
  function act(path, body) {
    return api(path, {
      method: 'POST', body: JSON.stringify(body),
      headers: { 'Content-Type': 'application/json', 'X-CSRF-Token': S.session.csrf_token },
    });
  }

  const enc = encodeURIComponent;

  // ------------------------------------------------------------ session

  function showSignin(message) {
    $('app-view').hidden = true;
    $('signout').hidden = true;
    $('who').textContent = '';
    $('head').textContent = '';
    $('signin-view').hidden = false;
    $('signin-error').textContent = message || '';
    setConn('off', 'signed out');
    $('token').focus();
  }

  function stopAll() {
    S.generation += 1;
    if (S.es) { S.es.close(); S.es = null; }
    clearTimeout(S.reconnectTimer);
    clearTimeout(S.renewTimer);
    clearTimeout(S.flushTimer);
    clearInterval(S.statusTimer);
    S.flushTimer = null;
    S.tasks.clear(); S.jobs.clear(); S.blockers = [];
    S.pendingTasks.clear(); S.pendingJobs.clear();
    S.page = null; S.past = null; S.status = null; S.verify = null;
    $('feed').replaceChildren();
  }

  function signedOut(message) {
    stopAll();
    S.session = null;
    showSignin(message);
  }

  function scheduleRenew() {
    clearTimeout(S.renewTimer);
    const after = Math.max(1, S.session.renew_after_seconds) * 1000;
    S.renewTimer = setTimeout(async () => {
      try {
        S.session = await api('/ui/session/renew', { method: 'POST' });
        scheduleRenew();
      } catch (e) {
        if (e instanceof Unauthorized) signedOut('Your session ended: ' + e.message);
        else { S.renewTimer = setTimeout(scheduleRenew, 5000); }
      }
    }, after);
  }

  async function start(session) {
    S.session = session;
    $('signin-view').hidden = true;
    $('app-view').hidden = false;
    $('signout').hidden = false;
    const acts = session.actions || [];
    $('who').textContent = `${session.name}${session.node ? ' @ ' + session.node : ''} ` +
      (acts.length ? `(${session.token_role}: may ${acts.join(', ')})` : '(read-only)');
    scheduleRenew();
    const gen = S.generation;
    try {
      await loadSnapshot(gen);
    } catch (e) {
      if (e instanceof Unauthorized) return signedOut(e.message);
      setConn('off', 'snapshot failed: ' + e.message);
      S.reconnectTimer = setTimeout(() => { if (gen === S.generation) start(session); }, 3000);
      return;
    }
    if (gen !== S.generation) return;
    openStream();
    onRoute();
    loadStatus();
    verifyChain();
    S.statusTimer = setInterval(loadStatus, 15000);
  }

  // ------------------------------------------------------------ snapshot

  async function allTasks(base) {
    const tasks = new Map();
    let after = null;
    for (;;) {
      const q = new URLSearchParams(base);
      q.set('limit', String(PAGE));
      if (after) q.set('after', after);
      const page = await api((q.has('as_of_seq') ? '/dashboard/tasks?' : '/tasks?') + q);
      for (const t of page.tasks) tasks.set(t.id, t);
      if (!page.next_after || page.tasks.length === 0) return tasks;
      after = page.next_after;
    }
  }

  async function loadSnapshot(gen) {
    // 1. The head first: everything up to it is in the views read next.
    const first = await api('/events?limit=1');
    const head = first.head_seq;
    // 2. The views.
    const tasks = await allTasks({});
    const jobs = new Map();
    let jafter = 0;
    for (;;) {
      const page = await api(`/jobs?limit=${PAGE}&after=${jafter}`);
      for (const j of page.jobs) jobs.set(j.job_id, j);
      if (page.jobs.length < PAGE) break;
      jafter = page.next_after;
    }
    const blockers = (await api('/blockers?open=true&limit=1000')).blockers;
    // 3. The last few events, for the feed.
    const recent = head > 0 ? await api(`/events?since_seq=${Math.max(0, head - 25)}&limit=25`) : { events: [] };
    if (gen !== S.generation) return;
    S.tasks = tasks; S.jobs = jobs; S.blockers = blockers;
    S.lastSeq = head; S.headAtLoad = head;
    $('feed').replaceChildren();
    for (const ev of recent.events) if (ev.seq <= head) addFeed(ev, true);
  }

  // ------------------------------------------------------------ stream

  function setConn(kind, text) {
    const el = $('conn');
    el.className = 'pill ' + ({ live: 'pill-live', wait: 'pill-wait', off: 'pill-off' }[kind]);
    el.textContent = text || kind;
    el.dataset.state = kind;
  }

  function openStream() {
    if (S.es) S.es.close();
    clearTimeout(S.reconnectTimer);
    const gen = S.generation;
    // Cookie auth (same origin): no token anywhere near this URL.
    const es = new EventSource('/stream?since_seq=' + S.lastSeq);
    S.es = es;
    const onEvent = (e) => { if (gen === S.generation && es === S.es) handle(e); };
    for (const t of S.session.event_types) es.addEventListener(t, onEvent);
    es.addEventListener('message', onEvent);  // an unnamed event, should there ever be one
    es.onopen = () => { S.reconnectDelay = 1000; setConn('live', 'live'); };
    es.onerror = () => {
      if (es !== S.es) return;
      if (es.readyState === EventSource.CONNECTING) {
        // The browser retries by itself, sending Last-Event-ID.
        setConn('wait', 'reconnecting…');
        return;
      }
      // The browser gave up (an error status, say an expired cookie): we retry,
      // from the last seq we applied, after checking the session.
      es.close();
      S.es = null;
      setConn('wait', 'reconnecting…');
      const delay = S.reconnectDelay;
      S.reconnectDelay = Math.min(S.reconnectDelay * 2, 5000);
      S.reconnectTimer = setTimeout(async () => {
        if (gen !== S.generation) return;
        try {
          S.session = await api('/ui/session');
        } catch (err) {
          if (err instanceof Unauthorized) return signedOut('Your session ended: ' + err.message);
          // the service is not reachable yet: try again later
        }
        if (gen === S.generation) openStream();
      }, delay);
    };
  }

  function handle(e) {
    const seq = Number(e.lastEventId);
    if (!Number.isSafeInteger(seq) || seq <= S.lastSeq) { S.duplicates += 1; return; }
    let ev;
    try { ev = JSON.parse(e.data); } catch { return; }
    S.lastSeq = seq;
    S.received += 1;
    addFeed(ev, false);
    apply(ev);
    renderHead();
  }

  function apply(ev) {
    const [kind, id] = splitStream(ev.stream);
    if (kind === 'task') {
      S.pendingTasks.add(id);
      if (ev.type === 'task.blocked' || ev.type === 'task.unblocked' || ev.type === 'task.cancelled') S.blockersDirty = true;
      const p = S.page;
      if (p && p.taskId === id) {
        if (!p.events.some((x) => x.seq === ev.seq)) p.events.push(ev);
        if (ev.type === 'task.blocked' || ev.type === 'task.unblocked' || ev.type === 'task.cancelled') loadPageBlockers(p);
        if (p.loaded) replayStates(p).catch(() => {});
      }
    } else if (kind === 'job') {
      S.pendingJobs.add(id);
    } else if (ev.type === 'audit.checkpoint') {
      loadStatus();
    }
    scheduleFlush();
  }

  function splitStream(stream) {
    const i = (stream || '').indexOf(':');
    return i < 0 ? [stream, ''] : [stream.slice(0, i), stream.slice(i + 1)];
  }

  function scheduleFlush() {
    if (S.flushTimer) return;
    S.flushTimer = setTimeout(flush, 80);
  }

  async function flush() {
    const gen = S.generation;
    const taskIds = [...S.pendingTasks]; S.pendingTasks.clear();
    const jobIds = [...S.pendingJobs]; S.pendingJobs.clear();
    const blockers = S.blockersDirty; S.blockersDirty = false;
    try {
      await Promise.all([
        ...taskIds.map(async (id) => {
          const t = await api('/tasks/' + enc(id));
          const old = S.tasks.get(id);
          if (!old || (t.seq || 0) >= (old.seq || 0)) { S.tasks.set(id, t); S.changed.add(id); }
        }),
        ...jobIds.map(async (id) => {
          const j = await api('/jobs/' + enc(id));
          const old = S.jobs.get(id);
          if (!old || (j.seq || 0) >= (old.seq || 0)) S.jobs.set(id, j);
        }),
        blockers ? api('/blockers?open=true&limit=1000').then((b) => { S.blockers = b.blockers; }) : null,
      ]);
    } catch (e) {
      if (e instanceof Unauthorized) { S.flushTimer = null; return signedOut(e.message); }
      // a transient failure: try these again shortly
      for (const id of taskIds) S.pendingTasks.add(id);
      for (const id of jobIds) S.pendingJobs.add(id);
      S.blockersDirty = S.blockersDirty || blockers;
      S.flushTimer = setTimeout(flush, 1000);
      return;
    }
    S.flushTimer = null;
    if (gen !== S.generation) return;
    renderAll();
    if (S.pendingTasks.size || S.pendingJobs.size || S.blockersDirty) scheduleFlush();
  }

  // ------------------------------------------------------------ routing

  function parseHash() {
    const raw = location.hash.replace(/^#/, '') || '/';
    const qi = raw.indexOf('?');
    const path = qi < 0 ? raw : raw.slice(0, qi);
    const params = new URLSearchParams(qi < 0 ? '' : raw.slice(qi + 1));
    const m = path.match(/^\/tasks\/(.+)$/);
    if (m) return { name: 'task', id: decodeURIComponent(m[1]), params };
    return { name: 'board', id: null, params };
  }

  function hashFor(name, id, params) {
    const q = params.toString();
    return (name === 'task' ? `#/tasks/${enc(id)}` : '#/') + (q ? '?' + q : '');
  }

  function asOfParam() {
    return S.asOf === null ? new URLSearchParams() : new URLSearchParams({ as_of: String(S.asOf) });
  }

  function taskHref(id) { return hashFor('task', id, asOfParam()); }

  function setHash(hash) {
    if (location.hash !== hash) history.replaceState(null, '', hash);
  }

  function onRoute() {
    if (!S.session) return;
    const route = parseHash();
    const raw = route.params.get('as_of');
    const asOf = raw !== null && /^\d+$/.test(raw) ? Number(raw) : null;
    const wasTask = S.route.name === 'task' ? S.route.id : null;
    S.route = route;
    if (asOf !== S.asOf) {
      S.asOf = asOf;
      if (asOf === null) S.past = null;
      else loadPast(asOf);
    }
    if (route.name === 'board') {
      S.boardHash = location.hash || '#/';
      readFilters(route.params);
      $('board-view').hidden = false;
      $('detail').hidden = true;
      S.page = null;
    } else {
      $('board-view').hidden = true;
      $('detail').hidden = false;
      $('detail-close').setAttribute('href', boardHashWithAsOf());
      if (!S.page || S.page.taskId !== route.id || wasTask !== route.id) openPage(route.id);
    }
    renderAll();
    if (route.name === 'task' && wasTask !== route.id) $('detail-title').focus();
  }

  function boardHashWithAsOf() {
    const r = S.boardHash.replace(/^#/, '');
    const qi = r.indexOf('?');
    const params = new URLSearchParams(qi < 0 ? '' : r.slice(qi + 1));
    params.delete('as_of');
    if (S.asOf !== null) params.set('as_of', String(S.asOf));
    return hashFor('board', null, params);
  }

  // ------------------------------------------------------------ time travel

  function setAsOf(seq) {
    const r = parseHash();
    if (seq === null) r.params.delete('as_of'); else r.params.set('as_of', String(seq));
    location.hash = hashFor(r.name, r.id, r.params);  // onRoute follows (hashchange)
  }

  async function loadPast(seq) {
    const gen = ++S.pastGen;
    S.past = null;
    $('tt-note').textContent = `loading the board as of seq ${seq}…`;
    try {
      const [tasks, blockers] = await Promise.all([
        allTasks({ as_of_seq: String(seq) }),
        api(`/dashboard/blockers?as_of_seq=${seq}`),
      ]);
      if (gen !== S.pastGen || S.asOf !== seq) return;
      S.past = { seq, tasks, blockers: blockers.blockers };
      $('tt-note').textContent = '';
    } catch (e) {
      if (e instanceof Unauthorized) return signedOut(e.message);
      if (gen === S.pastGen) $('tt-note').textContent = 'time travel: ' + e.message;
      return;
    }
    renderAll();
  }

  function shownTasks() {
    if (S.asOf === null) return S.tasks;
    return S.past && S.past.seq === S.asOf ? S.past.tasks : null;
  }

  function shownBlockers() {
    if (S.asOf === null) return S.blockers;
    return S.past && S.past.seq === S.asOf ? S.past.blockers : [];
  }

  function renderHead() {
    $('head').textContent = 'seq ' + S.lastSeq;
    const slider = $('tt-seq');
    slider.max = String(S.lastSeq);
    if (S.asOf === null) {
      slider.value = String(S.lastSeq);
      $('tt-value').textContent = `${S.lastSeq} (head)`;
    } else if (!slideTimer) {
      slider.value = String(S.asOf);
      $('tt-value').textContent = `${S.asOf} of ${S.lastSeq}`;
    }
    const mode = $('mode');
    mode.className = 'pill ' + (S.asOf === null ? 'pill-live' : 'pill-past');
    mode.textContent = S.asOf === null ? 'live' : `as of seq ${S.asOf}`;
    mode.dataset.asOf = S.asOf === null ? '' : String(S.asOf);
    $('tt-live').disabled = S.asOf === null;
  }

  let slideTimer = null;
  function onSlide() {
    const v = Number($('tt-seq').value);
    $('tt-value').textContent = `${v} of ${S.lastSeq}`;
    clearTimeout(slideTimer);
    slideTimer = setTimeout(() => { slideTimer = null; setAsOf(v); }, 250);
  }

  async function onDate() {
    const v = $('tt-date').value;
    if (!v) return;
    const when = new Date(v);  // the browser's local time zone
    if (Number.isNaN(when.getTime())) return;
    try {
      const r = await api('/dashboard/seq-at?at=' + enc(when.toISOString()));
      $('tt-note').textContent = r.seq === 0 ? 'nothing had happened by then' :
        `seq ${r.seq} was the last event by then (${r.recorded_at})`;
      setAsOf(r.seq);
    } catch (e) {
      if (e instanceof Unauthorized) return signedOut(e.message);
      $('tt-note').textContent = 'time travel: ' + e.message;
    }
  }

  // ------------------------------------------------------------ filters

  function readFilters(params) {
    for (const k of FILTER_KEYS) {
      const el = $('f-' + k);
      const v = params.get(k) || '';
      if (el.tagName === 'SELECT' && v && ![...el.options].some((o) => o.value === v)) el.append(h('option', { value: v }, v));
      if (el.value !== v) el.value = v;
    }
    $('show-verify').checked = params.get('verify') === '1';
  }

  function filtersFromForm() {
    const params = new URLSearchParams();
    for (const k of FILTER_KEYS) { const v = $('f-' + k).value.trim(); if (v) params.set(k, v); }
    if ($('show-verify').checked) params.set('verify', '1');
    if (S.asOf !== null) params.set('as_of', String(S.asOf));
    return params;
  }

  function onFilter() {
    S.colLimit.clear();
    const hash = hashFor('board', null, filtersFromForm());
    setHash(hash);
    S.boardHash = hash;
    renderBoard();
  }

  function matches(t, f) {
    if (t.task_type === 'verify' && !f.verify) return false;
    if (f.project && t.project !== f.project) return false;
    if (f.state && t.state !== f.state) return false;
    if (f.assignee && (f.assignee === '(none)' ? t.assignee : t.assignee !== f.assignee)) return false;
    if (f.label && !(t.labels || []).includes(f.label)) return false;
    if (f.q) {
      const q = f.q.toLowerCase();
      if (!t.id.toLowerCase().includes(q) && !(t.title || '').toLowerCase().includes(q)) return false;
    }
    return true;
  }

  function currentFilters() {
    const f = {};
    for (const k of FILTER_KEYS) f[k] = $('f-' + k).value.trim();
    f.verify = $('show-verify').checked;
    return f;
  }

  function fillOptions(id, values, extra) {
    const el = $(id);
    const chosen = el.value;
    const want = ['', ...extra, ...[...values].sort()];
    if (chosen && !want.includes(chosen)) want.push(chosen);
    const have = [...el.options].map((o) => o.value);
    if (have.length === want.length && have.every((v, i) => v === want[i])) return;
    el.replaceChildren(...want.map((v) => h('option', { value: v }, v || 'all')));
    el.value = chosen;
  }

  function refreshFilterOptions(tasks) {
    const projects = new Set(); const labels = new Set(); const assignees = new Set();
    for (const t of tasks.values()) {
      projects.add(t.project);
      for (const l of t.labels || []) labels.add(l);
      if (t.assignee) assignees.add(t.assignee);
    }
    fillOptions('f-project', projects, []);
    fillOptions('f-label', labels, []);
    fillOptions('f-assignee', assignees, ['(none)']);
    fillOptions('f-state', new Set(), ALL_STATES);
  }

  // ------------------------------------------------------------ rendering

  function renderAll() {
    renderHead();
    if (S.route.name === 'board') {
      renderBoard();
      renderJobs();
      renderParents();
      renderBlockers();
      renderTrust();
    } else if (S.page) {
      renderPage();
    }
    S.changed.clear();
  }

  const short = (id) => (id && id.length > 14 ? id.slice(0, 14) + '…' : id);

  function checkerNodes(t, tasks) {
    const out = new Map();
    for (const v of t.verdicts || []) if (v.node) out.set(v.node, v.outcome);
    for (const vid of t.verifier_task_ids || []) {
      const vt = tasks.get(vid);
      if (vt && vt.node && !out.has(vt.node)) out.set(vt.node, vt.state);
    }
    return out;
  }

  function taskCard(t, tasks) {
    const isVerify = t.task_type === 'verify';
    const makerNode = t.maker_node || (['claimed', 'running'].includes(t.state) && !isVerify ? t.node : null);
    const checkers = isVerify ? new Map() : checkerNodes(t, tasks);
    const meta = [
      h('span', { class: 'tag state' }, t.state),
      h('span', null, `attempt ${t.attempt}/${t.max_attempts}`),
      makerNode ? h('span', { class: 'maker' }, 'maker ' + makerNode) : null,
      isVerify && t.node ? h('span', { class: 'checker' }, 'checker ' + t.node) : null,
      [...checkers].map(([node, what]) => h('span', { class: 'checker ' + what }, `checker ${node}`)),
      isVerify ? h('span', { class: 'tag' }, 'checks ' + short(t.parent_task_id || '')) : null,
      t.is_parent ? h('span', { class: 'tag' }, 'round ' + (t.round ?? '–')) : null,
      t.assignee ? h('span', { class: 'tag assignee' }, '@' + t.assignee) : null,
      (t.labels || []).map((l) => h('span', { class: 'tag label' }, l)),
      t.escalated ? h('span', { class: 'tag esc' }, 'escalated') : null,
    ];
    const cls = ['task'];
    if (isVerify) cls.push('verify');
    if (S.changed.has(t.id) && S.asOf === null) cls.push('flash');
    return h('a', {
      class: cls.join(' '), href: taskHref(t.id),
      dataset: { id: t.id, state: t.state, attempt: String(t.attempt) },
    },
    h('span', { class: 'title' }, t.title),
    h('span', { class: 'meta' }, h('span', { class: 'mono' }, short(t.id)), t.project),
    h('span', { class: 'meta' }, meta));
  }

  function renderBoard() {
    const tasks = shownTasks();
    if (!tasks) {
      $('board').replaceChildren(h('p', { class: 'muted' }, `loading the board as of seq ${S.asOf}…`));
      $('board').dataset.asOf = '';
      return;
    }
    refreshFilterOptions(tasks);
    const f = currentFilters();
    const byCol = new Map(COLUMNS.map(([k]) => [k, []]));
    const other = [];
    let shown = 0;
    for (const t of tasks.values()) {
      if (!matches(t, f)) continue;
      shown += 1;
      const col = COLUMN_OF.get(t.state);
      (col ? byCol.get(col) : other).push(t);
    }
    const verifyCount = [...tasks.values()].filter((t) => t.task_type === 'verify').length;
    $('f-count').textContent = `${shown} of ${f.verify ? tasks.size : tasks.size - verifyCount} tasks shown`;
    const cols = COLUMNS.map(([key, label]) => [key, label, byCol.get(key)]);
    if (other.length) cols.push(['other', 'Other', other]);
    $('board').dataset.asOf = S.asOf === null ? 'live' : String(S.asOf);
    $('board').replaceChildren(...cols.map(([key, label, list]) => {
      list.sort((a, b) => (b.seq || 0) - (a.seq || 0));
      const limit = S.colLimit.get(key) || COLUMN_PAGE;
      const more = list.length - limit;
      return h('section', { class: 'col', dataset: { col: key }, 'aria-label': `${label}: ${list.length}` },
        h('h3', null, h('span', null, label), h('span', { class: 'count' }, list.length)),
        h('div', { class: 'tasks' }, list.length ? list.slice(0, limit).map((t) => taskCard(t, tasks)) : h('p', { class: 'empty' }, '—')),
        more > 0 ? h('button', {
          type: 'button', class: 'more', dataset: { col: key },
          onclick: () => { S.colLimit.set(key, limit + COLUMN_PAGE); renderBoard(); },
        }, `Show ${Math.min(COLUMN_PAGE, more)} more (${more} not shown)`) : null);
    }));
  }

  function fmtSecs(s) {
    if (s === null || s === undefined) return '—';
    s = Math.round(s);
    if (s < 60) return s + 's';
    const m = Math.floor(s / 60);
    return m < 60 ? `${m}m ${String(s % 60).padStart(2, '0')}s` : `${Math.floor(m / 60)}h ${String(m % 60).padStart(2, '0')}m`;
  }

  function renderJobs() {
    const active = new Set(['running', 'cancelling', 'pending']);
    const jobs = [...S.jobs.values()].sort((a, b) =>
      (active.has(b.state) - active.has(a.state)) || ((b.seq || 0) - (a.seq || 0))).slice(0, 60);
    $('jobs-count').textContent = S.asOf === null ? S.jobs.size : `${S.jobs.size} (live)`;
    $('jobs').replaceChildren(...(jobs.length ? jobs.map((j) => {
      const pct = Math.max(0, Math.min(100, Number(j.progress) || 0));
      return h('div', { class: 'job', dataset: { id: j.job_id, state: j.state } },
        h('div', { class: 'row' },
          h('span', { class: 'mono' }, j.job_id),
          h('span', null, h('span', { class: 'tag state' }, j.state), ' ', h('span', { class: 'tag' }, 'stage ' + j.stage))),
        h('div', { class: 'bar', role: 'progressbar', 'aria-label': `job ${j.job_id} progress`,
          'aria-valuemin': 0, 'aria-valuemax': 100, 'aria-valuenow': pct },
        h('span', { style: `width:${pct}%` })),
        h('div', { class: 'row small muted' },
          h('span', { class: 'progress' }, `${Math.round(pct)}% · ${j.completed_commands}/${j.total_commands} commands` +
            (j.failed_commands ? ` · ${j.failed_commands} failed` : '')),
          h('span', { class: 'eta' }, 'ETA ' + fmtSecs(j.eta_sec))),
        j.current_command ? h('div', { class: 'small current' }, '▶ ', h('code', null, j.current_command)) : null,
        j.node ? h('div', { class: 'small muted' }, `on ${j.node}`) : null,
        j.error ? h('div', { class: 'small error' }, j.error) : null);
    }) : [h('p', { class: 'empty' }, 'no jobs')]));
  }

  function renderParents() {
    const tasks = shownTasks() || new Map();
    const parents = [...tasks.values()].filter((t) => t.is_parent).sort((a, b) => (b.seq || 0) - (a.seq || 0));
    $('parents-count').textContent = parents.length;
    $('parents').replaceChildren(...(parents.length ? parents.slice(0, 100).map((p) =>
      h('div', { class: 'parent', dataset: { id: p.id } },
        h('div', null, h('a', { href: taskHref(p.id) }, p.title), ' ', h('span', { class: 'tag state' }, p.state),
          ' ', h('span', { class: 'tag' }, 'round ' + (p.round ?? '–'))),
        h('ul', { class: 'rounds' }, (p.rounds || []).map((r) => h('li', null, roundSummary(r, tasks)))))
    ) : [h('p', { class: 'empty' }, 'no parent tasks')]));
  }

  function roundSummary(r, tasks) {
    const counts = r.total !== null && r.total !== undefined
      ? `${r.done ?? 0}/${r.total} done, ${r.failed ?? 0} failed, ${r.cancelled ?? 0} cancelled`
      : subtaskStates(r.subtask_ids || [], tasks);
    return `round ${r.round}: ${counts}` + (r.decision ? ` — ${r.decision}` : '') + (r.notes ? ` (${r.notes})` : '');
  }

  function subtaskStates(ids, tasks) {
    const counts = new Map();
    for (const id of ids) {
      const st = tasks.has(id) ? tasks.get(id).state : 'unknown';
      counts.set(st, (counts.get(st) || 0) + 1);
    }
    const parts = [...counts].map(([st, n]) => `${n} ${st}`);
    return `${ids.length} sub-task${ids.length === 1 ? '' : 's'}` + (parts.length ? ` (${parts.join(', ')})` : '');
  }

  function renderBlockers() {
    const tasks = shownTasks() || new Map();
    const blockers = shownBlockers();
    $('blockers-count').textContent = blockers.length;
    $('blockers').replaceChildren(...(blockers.length ? blockers.map((b) => {
      const t = tasks.get(b.task_id);
      return h('div', { class: 'blocker', dataset: { id: b.id, task: b.task_id } },
        h('div', null, h('a', { href: taskHref(b.task_id) }, t ? t.title : b.task_id), ' ',
          h('span', { class: 'tag' }, b.category || 'uncategorised'), ' ',
          h('span', { class: 'muted small' }, `attempt ${b.attempt}`)),
        h('div', { class: 'small' }, b.reason),
        (b.unmet_requirements || []).length ? h('ul', { class: 'rounds' },
          b.unmet_requirements.map((u) => h('li', null, `${u.requirement_id}: ${u.reason}`))) : null);
    }) : [h('p', { class: 'empty' }, 'no open blockers')]));
  }

  // ------------------------------------------------------------ trust

  async function loadStatus() {
    if (!S.session) return;
    try {
      S.status = await api('/dashboard/status');
    } catch (e) {
      if (e instanceof Unauthorized) return signedOut(e.message);
      S.status = { error: e.message };
    }
    if (S.route.name === 'board') renderTrust();
  }

  // The chain check runs as the session's own role (it needs the CSRF header for that).
  async function verifyChain() {
    if (!S.session) return;
    S.verify = { running: true };
    renderTrust();
    try {
      S.verify = await api('/audit/verify', { headers: { 'X-CSRF-Token': S.session.csrf_token } });
    } catch (e) {
      if (e instanceof Unauthorized) return signedOut(e.message);
      S.verify = { error: e.status === 403 ? `checking the chain needs another role (${e.message})` : e.message };
    }
    renderTrust();
  }

  function renderTrust() {
    const st = S.status;
    const v = S.verify;
    let chain;
    if (!v || v.running) chain = h('span', { class: 'muted', dataset: { state: 'running' } }, 'checking…');
    else if (v.error) chain = h('span', { class: 'muted', dataset: { state: 'unknown' } }, v.error);
    else if (v.ok) chain = h('span', { class: 'ok', dataset: { state: 'ok' } },
      `✓ verified, seq ${v.from_seq ?? 1}–${v.to_seq ?? v.head_seq}`, v.checkpoints ? `, ${v.checkpoints} signed checkpoints checked` : '');
    else chain = h('span', { class: 'bad', dataset: { state: 'broken' } },
      `✗ broken at seq ${v.first_bad_seq}`, v.reason ? `: ${v.reason}` : '');
    const cp = st && st.last_checkpoint;
    const proc = st && st.process;
    const lagging = st && st.projections ? st.projections.filter((p) => p.lag) : [];
    $('trust').replaceChildren(
      kv([
        ['hash chain', h('span', { id: 'trust-chain' }, chain, ' ',
          h('button', { type: 'button', id: 'verify-again', onclick: verifyChain }, 'Verify again'))],
        ['head', st && !st.error ? h('span', { class: 'mono', title: st.head_hash }, `seq ${st.head_seq} · ${st.head_hash.slice(0, 12)}…`) : null],
        ['signed checkpoint', st && !st.error ? h('span', { id: 'trust-checkpoint' }, cp
          ? `seq ${cp.seq} over seq ${cp.data.covers_seq ?? '?'}` + (cp.data.key_id ? `, key ${cp.data.key_id}` : '') +
            ` at ${cp.recorded_at} (${st.checkpoints} in the log)`
          : 'none in the log') : null],
        ['projections', st && st.projections ? h('span', { id: 'trust-lag' }, lagging.length
          ? lagging.map((p) => `${p.name} ${p.lag} behind`).join(', ')
          : `${st.projections.length} current (lag 0)`) : null],
        ['subscribers', proc ? String(proc.sse_subscribers ?? '—') + (proc.sse_tailer_lag_events ? `, tailer ${proc.sse_tailer_lag_events} behind` : '') : null],
        ['writer', proc ? h('span', { id: 'trust-writer' },
          `${proc.writer_commits} batches, ${proc.writer_commands} commands, mean batch ${proc.writer_mean_batch ?? '—'}, queue ${proc.writer_queue_depth ?? '—'}`) : null],
        ['status', st && st.error ? h('span', { class: 'error' }, st.error) : null],
      ]));
  }

  // ------------------------------------------------------------ feed

  function summary(ev) {
    const d = ev.data || {};
    switch (ev.type) {
      case 'task.created': return d.title;
      case 'task.claimed': return `by ${d.worker}${d.node ? ' on ' + d.node : ''}, attempt ${d.attempt}`;
      case 'task.verdict': return `${d.checker}: ${d.outcome}` + (d.verdicts || []).map((v) => ` · ${v.requirement_id} ${v.verdict}${v.reason ? ' — ' + v.reason : ''}`).join('');
      case 'task.rejected': case 'task.retry_scheduled':
        return d.reason || (d.unmet_requirements || d.rework_notes || []).map((u) => `${u.requirement_id}: ${u.reason}`).join('; ');
      case 'task.blocked': return d.reason;
      case 'task.unblocked': return `${d.action}${d.notes ? ': ' + d.notes : ''}`;
      case 'task.cancelled': return d.reason || '';
      case 'task.reassigned': return d.assignee ? 'to ' + d.assignee : 'to anyone';
      case 'task.round_reviewed': return `round ${d.round}: ${d.decision}${d.notes ? ' — ' + d.notes : ''}`;
      case 'audit.checkpoint': return `signs seq ${d.covers_seq}`;
      case 'job.stage': return d.stage;
      case 'job.command_started': case 'job.command_completed': return d.command;
      default: return '';
    }
  }

  function addFeed(ev, history) {
    const [kind, id] = splitStream(ev.stream);
    const li = h('li', { dataset: { seq: String(ev.seq), type: ev.type, history: history ? '1' : '0' } },
      h('span', { class: 'seq' }, ev.seq),
      h('span', { class: 'muted' }, (ev.recorded_at || '').slice(11, 19)),
      h('span', { class: 'what' },
        h('span', { class: 'type' }, ev.type),
        kind === 'task' ? h('a', { class: 'stream', href: taskHref(id) }, ev.stream) : h('span', { class: 'stream' }, ev.stream),
        h('span', { class: 'muted' }, summary(ev) || '')));
    const feed = $('feed');
    feed.prepend(li);
    while (feed.childElementCount > FEED_MAX) feed.lastElementChild.remove();
    $('feed-count').textContent = S.received ? `+${S.received} live` : '';
  }

  // ------------------------------------------------------------ the task page

  function openPage(id) {
    S.page = { taskId: id, events: [], blockers: null, asOfView: null, asOfSeq: null, loaded: false,
      error: null, active: null, message: null };
    loadPage(S.page);
  }

  async function loadPage(p) {
    try {
      const events = [];
      let since = 0;
      for (;;) {
        const page = await api(`/tasks/${enc(p.taskId)}/events?since_seq=${since}&limit=1000`);
        events.push(...page.events);
        if (page.events.length < 1000) break;
        since = page.next_seq;
      }
      if (S.page !== p) return;
      const known = new Set(p.events.map((e) => e.seq));
      p.events = [...events.filter((e) => !known.has(e.seq)), ...p.events].sort((a, b) => a.seq - b.seq);
      if (!S.tasks.has(p.taskId)) S.tasks.set(p.taskId, await api('/tasks/' + enc(p.taskId)));
      await loadPageBlockers(p);
      p.loaded = true;
      renderPage();
      await replayStates(p);
    } catch (e) {
      if (e instanceof Unauthorized) return signedOut(e.message);
      if (S.page === p) { p.error = e.status === 404 ? `There is no task ${p.taskId}.` : 'history: ' + e.message; renderPage(); }
    }
  }

  async function loadPageBlockers(p) {
    const b = await api(`/blockers?task_id=${enc(p.taskId)}&limit=1000`);
    if (S.page === p) { p.blockers = b.blockers; if (p.loaded) renderPage(); }
  }

  async function loadPageAsOf(p, seq) {
    p.asOfSeq = seq;
    p.asOfView = null;
    try {
      const v = await api(`/tasks/${enc(p.taskId)}?as_of_seq=${seq}`);
      if (S.page === p && p.asOfSeq === seq) { p.asOfView = v; renderPage(); }
    } catch (e) {
      if (e instanceof Unauthorized) return signedOut(e.message);
      if (S.page === p && p.asOfSeq === seq) {
        p.asOfView = { missing: e.status === 404 ? `The task did not exist yet at seq ${seq}.` : e.message };
        renderPage();
      }
    }
  }

  // The state after each event, from GET /tasks/{id}?as_of_seq=N (a few at a time).
  async function replayStates(p) {
    const todo = p.events.filter((e) => !e.stateAfter && !e.loading);
    for (const e of todo) e.loading = true;
    let i = 0;
    const worker = async () => {
      while (i < todo.length && S.page === p) {
        const e = todo[i++];
        e.stateAfter = await api(`/tasks/${enc(p.taskId)}?as_of_seq=${e.seq}`);
      }
    };
    await Promise.all([worker(), worker(), worker(), worker()]);
    if (S.page === p) renderPage();
  }

  function kv(pairs) {
    return h('dl', { class: 'kv' }, pairs.filter(([, v]) => v !== null && v !== undefined && v !== '')
      .map(([k, v]) => [h('dt', null, k), h('dd', null, v)]));
  }

  function verdictBlock(v) {
    return h('div', { class: 'verdict', dataset: { checker: v.checker } },
      h('div', null, h('strong', { class: v.outcome }, v.outcome), ` · checker ${v.checker}`,
        v.node ? ` on ${v.node}` : '', v.worker ? ` (${v.worker})` : '', v.category ? ` · ${v.category}` : '',
        v.verifier_task_id ? [' · ', h('a', { href: taskHref(v.verifier_task_id) }, v.verifier_task_id)] : ''),
      (v.verdicts || []).length ? h('table', null,
        h('thead', null, h('tr', null, h('th', { scope: 'col' }, 'requirement'), h('th', { scope: 'col' }, 'verdict'),
          h('th', { scope: 'col' }, 'reason'))),
        h('tbody', null, v.verdicts.map((r) => h('tr', { class: 'req' }, h('td', { class: 'mono' }, r.requirement_id),
          h('td', { class: r.verdict }, r.verdict), h('td', { class: 'reason' }, r.reason || '—'))))) : null);
  }

  function notesTable(notes) {
    return h('table', { class: 'notes' },
      h('thead', null, h('tr', null, h('th', { scope: 'col' }, 'requirement'), h('th', { scope: 'col' }, 'reason'),
        h('th', { scope: 'col' }, 'checker'))),
      h('tbody', null, notes.map((n) => h('tr', null, h('td', { class: 'mono' }, n.requirement_id),
        h('td', null, n.reason || '—'), h('td', null, n.checker || '—')))));
  }

  function stateSections(t) {
    const out = [];
    if ((t.verdicts || []).length) out.push(h('h4', null, 'Verdicts'), t.verdicts.map(verdictBlock));
    else if ((t.previous_verdicts || []).length) {
      out.push(h('h4', null, 'Verdicts of the last judged attempt'), t.previous_verdicts.map(verdictBlock));
    }
    if (t.task_type === 'verify' && t.outcome) {
      out.push(h('h4', null, 'This check'), verdictBlock({ checker: t.checker, outcome: t.outcome,
        verdicts: t.verify_verdicts, node: t.node, worker: t.worker, category: t.category }));
    }
    if ((t.rework_notes || []).length) out.push(h('h4', null, 'Rework notes'), notesTable(t.rework_notes));
    return out;
  }

  const when = (iso) => (iso || '').replace('T', ' ').replace(/\.\d+Z$/, 'Z');

  function who(ev) {
    const m = ev.meta || {};
    return `${m.actor || '—'}${m.role ? ' (' + m.role + ')' : ''}`;
  }

  // Attempts, grouped from the events: each with its claims, verdicts and end.
  function attemptsOf(events) {
    const byAttempt = new Map();
    let current = 1;
    const get = (n) => {
      if (!byAttempt.has(n)) byAttempt.set(n, { n, events: [], verdicts: [], rework: null, end: null });
      return byAttempt.get(n);
    };
    for (const ev of events) {
      const d = ev.data || {};
      if (ev.type === 'task.retry_scheduled') {
        current = d.attempt;
        get(current).rework = d.rework_notes || [];
        get(current - 1).end = ev;
        continue;
      }
      const n = typeof d.attempt === 'number' ? d.attempt : null;
      if (n === null && !['task.claimed', 'task.started', 'task.completed', 'task.cancelled', 'task.collected'].includes(ev.type)) continue;
      if (n !== null) current = n;
      const a = get(current);
      a.events.push(ev);
      if (ev.type === 'task.verdict') a.verdicts.push({ ...d });
      if (['task.verified', 'task.rejected', 'task.blocked', 'task.failed', 'task.lease_expired', 'task.deadlettered',
        'task.cancelled', 'task.collected'].includes(ev.type) && !a.end) a.end = ev;
    }
    return [...byAttempt.values()].filter((a) => a.events.length || a.rework).sort((a, b) => a.n - b.n);
  }

  function attemptView(a) {
    const claim = a.events.find((e) => e.type === 'task.claimed');
    const done = a.events.find((e) => e.type === 'task.completed');
    return h('section', { class: 'attempt', dataset: { attempt: String(a.n) }, 'aria-label': `attempt ${a.n}` },
      h('h4', null, `Attempt ${a.n}`, a.end ? h('span', { class: 'tag state' }, a.end.type.replace('task.', '')) : ''),
      a.rework && a.rework.length ? [h('p', { class: 'small' }, 'Rework notes handed to this attempt:'), notesTable(a.rework)] : null,
      kv([
        ['claimed', claim ? `${when(claim.recorded_at)} by ${claim.data.worker}${claim.data.node ? ' on ' + claim.data.node : ''}` : null],
        ['completed', done ? when(done.recorded_at) : null],
        ['ended', a.end ? `${when(a.end.recorded_at)}: ${a.end.type}${summary(a.end) ? ' — ' + summary(a.end) : ''}` : null],
      ]),
      a.verdicts.map(verdictBlock));
  }

  function blockerView(b, asOf) {
    const resolved = b.resolved_seq !== null && b.resolved_seq !== undefined && (asOf === null || b.resolved_seq <= asOf);
    return h('div', { class: 'blocker-rec', dataset: { id: b.id, open: resolved ? '0' : '1' } },
      h('div', null, h('strong', null, b.reason), ' ', h('span', { class: 'tag' }, b.category || 'uncategorised'),
        ' ', h('span', { class: 'muted small' }, `attempt ${b.attempt}, opened at seq ${b.opened_seq} (${when(b.opened_at)})`)),
      (b.unmet_requirements || []).length ? notesTable(b.unmet_requirements) : null,
      h('p', { class: 'resolution' }, resolved
        ? `Resolved at seq ${b.resolved_seq} (${when(b.resolved_at)}): ${b.resolution}${b.notes ? ' — ' + b.notes : ''}`
        : 'Open.'));
  }

  function linkList(ids, tasks) {
    return h('ul', { class: 'links' }, ids.map((id) => {
      const t = tasks.get(id);
      return h('li', null, h('a', { href: taskHref(id), dataset: { id } }, id), t ? [' ', h('span', { class: 'tag state' }, t.state), ' ', t.title] : '');
    }));
  }

  function roundView(r, tasks) {
    const answered = r.decision !== null && r.decision !== undefined;
    return h('section', { class: 'round', dataset: { round: String(r.round) }, 'aria-label': `round ${r.round}` },
      h('h4', null, `Round ${r.round}`),
      h('p', { class: 'small' }, roundSummary(r, tasks)),
      linkList(r.subtask_ids || [], tasks),
      answered ? kv([
        ['decision', r.decision], ['reviewed by', r.reviewed_by],
        ['goal clear?', r.goal_clear === true ? 'yes' : r.goal_clear === false ? 'no' : r.goal_clear],
        ['coverage', r.coverage], ['next round', r.next_round], ['notes', r.notes],
      ]) : null);
  }

  function renderPage() {
    const p = S.page;
    if (!p) return;
    const timeTravel = S.asOf !== null;
    if (timeTravel && p.asOfSeq !== S.asOf) loadPageAsOf(p, S.asOf);
    const t = timeTravel ? p.asOfView : S.tasks.get(p.taskId);
    const tasks = (timeTravel ? shownTasks() : S.tasks) || S.tasks;
    $('detail').dataset.id = p.taskId;
    $('detail').dataset.asOf = timeTravel ? String(S.asOf) : 'live';
    $('detail-title').textContent = t && t.title ? t.title : p.taskId;
    $('detail-title').setAttribute('tabindex', '-1');
    if (p.error) { $('detail-body').replaceChildren(h('p', { class: 'error', role: 'alert' }, p.error)); return; }
    if (!t) { $('detail-body').replaceChildren(h('p', { class: 'muted' }, 'loading…')); return; }
    if (t.missing) { $('detail-body').replaceChildren(h('p', { class: 'muted', id: 'not-yet' }, t.missing)); return; }
    const events = p.events.filter((e) => !timeTravel || e.seq <= S.asOf);
    const blockers = (p.blockers || []).filter((b) => !timeTravel || b.opened_seq <= S.asOf);
    const verifiers = t.all_verifier_task_ids && t.all_verifier_task_ids.length ? t.all_verifier_task_ids : (t.verifier_task_ids || []);
    const body = [
      timeTravel ? h('p', { class: 'asof-banner', role: 'status' }, `As of seq ${S.asOf}. `,
        h('a', { href: hashFor('task', p.taskId, new URLSearchParams()) }, 'Back to live')) : null,
      kv([
        ['id', h('span', { class: 'mono' }, t.id)], ['state', h('span', { class: 'tag state', id: 'page-state' }, t.state)],
        ['project', t.project], ['type', t.task_type], ['attempt', `${t.attempt} of ${t.max_attempts}`],
        ['assignee', h('span', { id: 'page-assignee' }, t.assignee || 'anyone')],
        ['labels', (t.labels || []).join(', ')],
        ['maker', t.maker_node ? `${t.maker_node}${t.maker_worker ? ' (' + t.maker_worker + ')' : ''}` : null],
        ['last node', t.node ? `${t.node}${t.worker ? ' (' + t.worker + ')' : ''}` : null],
        ['checkers', t.verification ? t.verification.checkers.join(', ') : (t.task_type === 'verify' ? t.checker : 'none')],
        ['parent', t.parent_task_id ? h('a', { href: taskHref(t.parent_task_id), id: 'page-parent' }, t.parent_task_id) : null],
        ['round', t.is_parent ? t.round : t.subtask_round],
        ['escalated', t.escalated ? 'yes' : null], ['error', t.error],
        ['created', when(t.created_at)], ['updated', when(t.updated_at)], ['seq', t.seq],
      ]),
      timeTravel ? null : actionsView(t),
      (t.requirements || []).length ? [h('h3', null, 'Requirements'), h('table', { class: 'reqs' },
        h('tbody', null, t.requirements.map((r) => h('tr', null, h('td', { class: 'mono' }, r.id), h('td', null, r.text)))))] : null,
      stateSections(t),
      h('h3', null, 'Attempts'),
      h('div', { id: 'attempts' }, p.loaded ? attemptsOf(events).map(attemptView) : h('p', { class: 'muted' }, 'loading…')),
      verifiers.length ? [h('h3', null, 'Verifier tasks'), h('div', { id: 'verifiers' }, linkList(verifiers, tasks))] : null,
      t.is_parent && (t.rounds || []).length ? [h('h3', null, 'Rounds and sub-tasks'),
        h('div', { id: 'rounds' }, t.rounds.map((r) => roundView(r, tasks)))] : null,
      blockers.length ? [h('h3', null, 'Blockers'), h('div', { id: 'page-blockers' }, blockers.map((b) => blockerView(b, S.asOf)))] : null,
      h('h3', null, 'Timeline ', h('span', { class: 'muted small' }, '(choose a step for the state after it, from the replay API)')),
      timelineView(p, events),
    ];
    const focused = document.activeElement && $('detail-body').contains(document.activeElement) ? document.activeElement.id : null;
    // A live event redraws the page while someone may be filling an action form:
    // what they typed survives the redraw (the forms are built from the task).
    const typed = new Map();
    $('detail-body').querySelectorAll('form.act input, form.act textarea, form.act select').forEach((el) => {
      if (el.id && el.dataset.edited) typed.set(el.id, el.value);
    });
    $('detail-body').replaceChildren(...body.flat(Infinity).filter(Boolean));
    typed.forEach((value, id) => { const el = $(id); if (el) { el.value = value; el.dataset.edited = '1'; } });
    if (focused && $(focused)) $(focused).focus();
  }

  function timelineView(p, events) {
    if (!p.loaded) return h('p', { class: 'muted' }, 'loading history…');
    const table = h('table', { class: 'history' },
      h('caption', { class: 'visually-hidden' }, 'events of this task, oldest first'),
      h('thead', null, h('tr', null, ['#', 'seq', 'when', 'event', 'who', 'node', 'what', 'state after'].map((c) => h('th', { scope: 'col' }, c)))),
      h('tbody', null, events.map((ev) => {
        const m = ev.meta || {};
        const toggle = () => { p.active = p.active === ev.seq ? null : ev.seq; renderPage(); };
        return h('tr', { class: p.active === ev.seq ? 'active' : null, dataset: { seq: String(ev.seq), type: ev.type } },
          h('td', null, ev.stream_seq), h('td', { class: 'mono' }, ev.seq), h('td', { class: 'when' }, when(ev.recorded_at)),
          h('td', { class: 'type' }, h('button', { type: 'button', class: 'linkish', id: `step-${ev.seq}`,
            'aria-expanded': p.active === ev.seq ? 'true' : 'false', onclick: toggle }, ev.type)),
          h('td', { class: 'who' }, who(ev)), h('td', { class: 'node' }, m.node || (ev.data && ev.data.node) || '—'),
          h('td', { class: 'what' }, summary(ev)),
          h('td', { class: 'after' }, ev.stateAfter ? `${ev.stateAfter.state} · attempt ${ev.stateAfter.attempt}` : '…'));
      })));
    const active = events.find((e) => e.seq === p.active);
    return [table, active ? asOfView(active) : null];
  }

  function asOfView(ev) {
    const s = ev.stateAfter;
    return h('div', { class: 'asof', dataset: { seq: String(ev.seq) } },
      h('div', null, h('strong', null, `As of seq ${ev.seq}`), ` — after ${ev.type}`),
      s ? [kv([['state', s.state], ['attempt', s.attempt], ['maker', s.maker_node], ['on', s.node],
        ['blocker', s.blocker_id], ['verifier tasks', (s.verifier_task_ids || []).join(', ')]]), stateSections(s)]
        : h('p', { class: 'muted' }, 'loading…'),
      h('h4', null, 'Event data'), h('pre', { class: 'mono' }, JSON.stringify(ev.data, null, 2)));
  }

  // ------------------------------------------------------------ acting

  function field(id, label, input) {
    return h('div', { class: 'field' }, h('label', { for: id }, label), input);
  }

  function actionForm(name, title, fields, submitText, build) {
    const form = h('form', { class: 'act', id: 'act-' + name, 'aria-label': title },
      h('h4', null, title), fields, h('button', { type: 'submit' }, submitText));
    form.addEventListener('input', (e) => { e.target.dataset.edited = '1'; });
    form.addEventListener('change', (e) => { e.target.dataset.edited = '1'; });
    form.addEventListener('submit', async (e) => {
      e.preventDefault();
      const p = S.page;
      const [path, body] = build(form);
      const btn = form.querySelector('button[type=submit]');
      btn.disabled = true;
      try {
        const t = await act(path, body);
        if (t && t.id) { S.tasks.set(t.id, t); }
        form.querySelectorAll('[data-edited]').forEach((el) => { delete el.dataset.edited; });
        p.message = { ok: true, text: `${title}: done (now ${t && t.state ? t.state : 'updated'}).` };
      } catch (err) {
        if (err instanceof Unauthorized) return signedOut(err.message);
        p.message = { ok: false, text: `${title}: refused (${err.status || ''} ${err.body && err.body.code ? err.body.code : ''}): ${err.message}` };
      }
      if (S.page === p) renderPage();
    });
    return form;
  }

  function actionsView(t) {
    const can = new Set((S.session && S.session.actions) || []);
    const p = S.page;
    const msg = p && p.message ? h('p', { id: 'act-result', role: p.message.ok ? 'status' : 'alert',
      class: p.message.ok ? 'ok' : 'error' }, p.message.text) : h('p', { id: 'act-result', role: 'status' });
    if (!can.size) {
      return h('section', { class: 'actions', 'aria-labelledby': 'actions-h' }, h('h3', { id: 'actions-h' }, 'Actions'),
        h('p', { class: 'muted', id: 'readonly-note' },
          `Read-only: this session's token has the ${S.session ? S.session.token_role : 'reader'} role, which may not act on tasks.`));
    }
    const id = enc(t.id);
    const forms = [];
    if (can.has('unblock') && t.state === 'blocked') {
      forms.push(actionForm('unblock', 'Unblock', [
        field('unblock-action', 'Then', h('select', { id: 'unblock-action' },
          h('option', { value: 'retry' }, 'retry (back to pending, attempts reset)'),
          h('option', { value: 'reverify' }, 'reverify (new checkers, same attempt)'))),
        field('unblock-notes', 'Notes', h('textarea', { id: 'unblock-notes', rows: 2 })),
      ], 'Unblock', (f) => [`/tasks/${id}/unblock`, {
        action: f.querySelector('#unblock-action').value,
        notes: f.querySelector('#unblock-notes').value || null,
      }]));
    }
    if (can.has('reassign') && !TERMINAL.has(t.state) && !t.is_parent) {
      forms.push(actionForm('reassign', 'Reassign', [
        field('reassign-to', 'Assignee (empty: anyone)', h('input', { id: 'reassign-to', type: 'text', value: t.assignee || '', spellcheck: 'false' })),
      ], 'Reassign', (f) => [`/tasks/${id}/reassign`, { assignee: f.querySelector('#reassign-to').value.trim() || null }]));
    }
    if (can.has('cancel') && !TERMINAL.has(t.state)) {
      forms.push(actionForm('cancel', 'Cancel', [
        field('cancel-reason', 'Reason', h('input', { id: 'cancel-reason', type: 'text' })),
      ], 'Cancel the task', (f) => [`/tasks/${id}/cancel`, { reason: f.querySelector('#cancel-reason').value }]));
    }
    if (can.has('round-review') && t.state === 'round_review') {
      forms.push(actionForm('review', `Review round ${t.round}`, [
        h('fieldset', null, h('legend', null, 'Decision'),
          h('label', { class: 'check' }, h('input', { type: 'radio', name: 'decision', value: 'GOAL_ACHIEVED', id: 'review-goal', checked: true }), ' goal achieved'),
          h('label', { class: 'check' }, h('input', { type: 'radio', name: 'decision', value: 'NEW_ROUND', id: 'review-new' }), ' new round')),
        field('review-goal-clear', 'Is the goal clear?', h('select', { id: 'review-goal-clear' },
          h('option', { value: 'true' }, 'yes'), h('option', { value: 'false' }, 'no'))),
        field('review-coverage', 'Coverage: which requirements did the round meet?', h('textarea', { id: 'review-coverage', rows: 2, required: true })),
        field('review-next', 'Next round: what is left to do?', h('textarea', { id: 'review-next', rows: 2, required: true })),
        field('review-notes', 'Notes', h('textarea', { id: 'review-notes', rows: 2 })),
        field('review-subtasks', 'New sub-tasks, one title a line (new round only)', h('textarea', { id: 'review-subtasks', rows: 3 })),
      ], 'Submit the review', (f) => {
        const decision = f.querySelector('input[name=decision]:checked').value;
        const titles = f.querySelector('#review-subtasks').value.split('\n').map((s) => s.trim()).filter(Boolean);
        return [`/tasks/${id}/round-review`, {
          decision, notes: f.querySelector('#review-notes').value,
          goal_clear: f.querySelector('#review-goal-clear').value === 'true',
          coverage: f.querySelector('#review-coverage').value, next_round: f.querySelector('#review-next').value,
          new_subtasks: decision === 'NEW_ROUND' ? titles.map((title) => ({ title })) : [],
        }];
      }));
    }
    return h('section', { class: 'actions', 'aria-labelledby': 'actions-h' },
      h('h3', { id: 'actions-h' }, 'Actions'),
      forms.length ? forms : h('p', { class: 'muted' }, `Nothing a ${S.session.token_role} may do in state ${t.state}.`),
      msg);
  }

  // ------------------------------------------------------------ wiring

  $('signin').addEventListener('submit', async (e) => {
    e.preventDefault();
    const input = $('token');
    const token = input.value.trim();
    $('signin-error').textContent = '';
    try {
      const session = await api('/ui/session', {
        method: 'POST', body: JSON.stringify({ token }), headers: { 'Content-Type': 'application/json' },
      });
      input.value = '';
      start(session);
    } catch (err) {
      $('signin-error').textContent = err instanceof Unauthorized ? 'That token was not accepted.' : err.message;
    }
  });
  $('signout').addEventListener('click', async () => {
    try { await api('/ui/session', { method: 'DELETE' }); } catch { /* signing out anyway */ }
    signedOut('Signed out.');
  });
  window.addEventListener('hashchange', onRoute);
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Escape' && S.route.name === 'task' && !e.target.closest('form')) location.hash = $('detail-close').getAttribute('href');
  });
  $('filters').addEventListener('submit', (e) => e.preventDefault());
  $('filters').addEventListener('change', onFilter);
  $('f-q').addEventListener('input', onFilter);
  $('f-clear').addEventListener('click', () => {
    for (const k of FILTER_KEYS) $('f-' + k).value = '';
    $('show-verify').checked = false;
    onFilter();
  });
  $('tt-seq').addEventListener('input', onSlide);
  $('tt-date').addEventListener('change', onDate);
  $('tt-live').addEventListener('click', () => setAsOf(null));

  (async () => {
    try {
      start(await api('/ui/session'));
    } catch (e) {
      showSignin(e instanceof Unauthorized ? '' : 'The service is not reachable: ' + e.message);
    }
  })();
})();
