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

  const FEED_MAX = 300;
  const PAGE = 1000;

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
    pendingTasks: new Set(),
    pendingJobs: new Set(),
    blockersDirty: false,
    flushTimer: null,
    changed: new Set(),
    selected: null,
    history: null,    // {taskId, rows: [{event, state}], active}
    generation: 0,    // bumps on sign-out so late answers are dropped
  };
  // Read-only counters for tests and curious people.
  window.taskledgerDashboard = {
    get lastSeq() { return S.lastSeq; },
    get headAtLoad() { return S.headAtLoad; },
    get received() { return S.received; },
    get duplicates() { return S.duplicates; },
    get connected() { return !!S.es && S.es.readyState === 1; },
  };

  class Unauthorized extends Error {}

  async function api(path, opts = {}) {
    const r = await fetch(path, {
      credentials: 'same-origin',
      cache: 'no-store',
      ...opts,
      headers: { Accept: 'application/json', ...(opts.headers || {}) },
    });
    if (r.status === 401) throw new Unauthorized(await detail(r));
    if (!r.ok) throw new Error(`${r.status}: ${await detail(r)}`);
    return r.status === 204 ? null : r.json();
  }

  async function detail(r) {
    try { const b = await r.json(); return b.detail || b.title || r.statusText; } catch { return r.statusText; }
  }

  // ------------------------------------------------------------ session

  function showSignin(message) {
    $('app-view').hidden = true;
    $('detail').hidden = true;
    $('signout').hidden = true;
    $('verify-toggle-wrap').hidden = true;
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
    S.flushTimer = null;
    S.tasks.clear(); S.jobs.clear(); S.blockers = [];
    S.pendingTasks.clear(); S.pendingJobs.clear();
    S.selected = null; S.history = null;
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
    $('verify-toggle-wrap').hidden = false;
    $('who').textContent = `${session.name}${session.node ? ' @ ' + session.node : ''} (read-only)`;
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
    if (gen === S.generation) openStream();
  }

  // ------------------------------------------------------------ snapshot

  async function loadSnapshot(gen) {
    // 1. The head first: everything up to it is in the views read next.
    const first = await api('/events?limit=1');
    const head = first.head_seq;
    // 2. The views.
    const tasks = new Map();
    let after = null;
    for (;;) {
      const q = new URLSearchParams({ limit: String(PAGE) });
      if (after) q.set('after', after);
      const page = await api('/tasks?' + q);
      for (const t of page.tasks) tasks.set(t.id, t);
      if (!page.next_after || page.tasks.length === 0) break;
      after = page.next_after;
    }
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
    renderAll();
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
    $('head').textContent = 'seq ' + S.lastSeq;
  }

  function apply(ev) {
    const [kind, id] = splitStream(ev.stream);
    if (kind === 'task') {
      S.pendingTasks.add(id);
      if (ev.type === 'task.blocked' || ev.type === 'task.unblocked' || ev.type === 'task.cancelled') S.blockersDirty = true;
      if (S.history && S.history.taskId === id) appendHistory(ev);
    } else if (kind === 'job') {
      S.pendingJobs.add(id);
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
          const t = await api('/tasks/' + encodeURIComponent(id));
          const old = S.tasks.get(id);
          if (!old || (t.seq || 0) >= (old.seq || 0)) { S.tasks.set(id, t); S.changed.add(id); }
        }),
        ...jobIds.map(async (id) => {
          const j = await api('/jobs/' + encodeURIComponent(id));
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

  // ------------------------------------------------------------ rendering

  function renderAll() {
    $('head').textContent = 'seq ' + S.lastSeq;
    renderBoard();
    renderJobs();
    renderParents();
    renderBlockers();
    if (S.selected) renderDetail();
    S.changed.clear();
  }

  const short = (id) => (id && id.length > 14 ? id.slice(0, 14) + '…' : id);

  function checkerNodes(t) {
    const out = new Map();
    for (const v of t.verdicts || []) if (v.node) out.set(v.node, v.outcome);
    for (const vid of t.verifier_task_ids || []) {
      const vt = S.tasks.get(vid);
      if (vt && vt.node && !out.has(vt.node)) out.set(vt.node, vt.state);
    }
    return out;
  }

  function taskCard(t) {
    const isVerify = t.task_type === 'verify';
    const makerNode = t.maker_node || (['claimed', 'running'].includes(t.state) && !isVerify ? t.node : null);
    const checkers = isVerify ? new Map() : checkerNodes(t);
    const meta = [
      h('span', { class: 'tag state' }, t.state),
      h('span', { title: 'attempt' }, `attempt ${t.attempt}/${t.max_attempts}`),
      makerNode ? h('span', { class: 'maker' }, 'maker ' + makerNode) : null,
      isVerify && t.node ? h('span', { class: 'checker' }, 'checker ' + t.node) : null,
      [...checkers].map(([node, what]) => h('span', { class: 'checker ' + what }, `checker ${node}`)),
      isVerify ? h('span', { class: 'tag' }, 'checks ' + short(t.parent_task_id || '')) : null,
      t.is_parent ? h('span', { class: 'tag' }, 'round ' + (t.round ?? '–')) : null,
      t.escalated ? h('span', { class: 'tag esc' }, 'escalated') : null,
    ];
    const cls = ['task'];
    if (isVerify) cls.push('verify');
    if (S.changed.has(t.id)) cls.push('flash');
    if (S.selected === t.id) cls.push('selected');
    return h('div', {
      class: cls.join(' '), dataset: { id: t.id, state: t.state, attempt: String(t.attempt) },
      onclick: () => openTask(t.id), title: t.id,
    },
    h('div', { class: 'title' }, t.title),
    h('div', { class: 'meta' }, h('span', { class: 'mono' }, short(t.id)), t.project),
    h('div', { class: 'meta' }, meta));
  }

  function renderBoard() {
    const showVerify = $('show-verify').checked;
    const byCol = new Map(COLUMNS.map(([k]) => [k, []]));
    const other = [];
    for (const t of S.tasks.values()) {
      if (t.task_type === 'verify' && !showVerify) continue;
      const col = COLUMN_OF.get(t.state);
      (col ? byCol.get(col) : other).push(t);
    }
    const cols = COLUMNS.map(([key, label]) => [key, label, byCol.get(key)]);
    if (other.length) cols.push(['other', 'Other', other]);
    $('board').replaceChildren(...cols.map(([key, label, list]) => {
      list.sort((a, b) => (b.seq || 0) - (a.seq || 0));
      return h('div', { class: 'col', dataset: { col: key } },
        h('h2', null, h('span', null, label), h('span', { class: 'count' }, list.length)),
        h('div', { class: 'tasks' }, list.length ? list.map(taskCard) : h('div', { class: 'empty' }, '—')));
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
    $('jobs-count').textContent = S.jobs.size;
    $('jobs').replaceChildren(...(jobs.length ? jobs.map((j) => {
      const pct = Math.max(0, Math.min(100, Number(j.progress) || 0));
      return h('div', { class: 'job', dataset: { id: j.job_id, state: j.state } },
        h('div', { class: 'row' },
          h('span', { class: 'mono' }, j.job_id),
          h('span', null, h('span', { class: 'tag state' }, j.state), ' ', h('span', { class: 'tag' }, 'stage ' + j.stage))),
        h('div', { class: 'bar', role: 'progressbar', 'aria-valuemin': 0, 'aria-valuemax': 100, 'aria-valuenow': pct },
          h('span', { style: `width:${pct}%` })),
        h('div', { class: 'row small muted' },
          h('span', { class: 'progress' }, `${Math.round(pct)}% · ${j.completed_commands}/${j.total_commands} commands` +
            (j.failed_commands ? ` · ${j.failed_commands} failed` : '')),
          h('span', { class: 'eta' }, 'ETA ' + fmtSecs(j.eta_sec))),
        j.current_command ? h('div', { class: 'small current' }, '▶ ', h('code', null, j.current_command)) : null,
        j.node ? h('div', { class: 'small muted' }, `on ${j.node}`) : null,
        j.error ? h('div', { class: 'small error' }, j.error) : null);
    }) : [h('div', { class: 'empty' }, 'no jobs')]));
  }

  function renderParents() {
    const parents = [...S.tasks.values()].filter((t) => t.is_parent).sort((a, b) => (b.seq || 0) - (a.seq || 0));
    $('parents-count').textContent = parents.length;
    $('parents').replaceChildren(...(parents.length ? parents.map((p) =>
      h('div', { class: 'parent', dataset: { id: p.id }, onclick: () => openTask(p.id) },
        h('div', null, h('strong', null, p.title), ' ', h('span', { class: 'tag state' }, p.state),
          ' ', h('span', { class: 'tag' }, 'round ' + (p.round ?? '–'))),
        h('ul', { class: 'rounds' }, (p.rounds || []).map((r) => h('li', null, roundSummary(r)))))
    ) : [h('div', { class: 'empty' }, 'no parent tasks')]));
  }

  function roundSummary(r) {
    const counts = r.total !== null && r.total !== undefined
      ? `${r.done ?? 0}/${r.total} done, ${r.failed ?? 0} failed, ${r.cancelled ?? 0} cancelled`
      : subtaskStates(r.subtask_ids || []);
    return `round ${r.round}: ${counts}` + (r.decision ? ` — ${r.decision}` : '') + (r.notes ? ` (${r.notes})` : '');
  }

  function subtaskStates(ids) {
    const counts = new Map();
    for (const id of ids) {
      const st = S.tasks.has(id) ? S.tasks.get(id).state : 'unknown';
      counts.set(st, (counts.get(st) || 0) + 1);
    }
    const parts = [...counts].map(([st, n]) => `${n} ${st}`);
    return `${ids.length} sub-task${ids.length === 1 ? '' : 's'}` + (parts.length ? ` (${parts.join(', ')})` : '');
  }

  function renderBlockers() {
    $('blockers-count').textContent = S.blockers.length;
    $('blockers').replaceChildren(...(S.blockers.length ? S.blockers.map((b) => {
      const t = S.tasks.get(b.task_id);
      return h('div', { class: 'blocker', dataset: { id: b.id, task: b.task_id }, onclick: () => openTask(b.task_id) },
        h('div', null, h('strong', null, t ? t.title : b.task_id), ' ',
          h('span', { class: 'tag' }, b.category || 'uncategorised'), ' ',
          h('span', { class: 'muted small' }, `attempt ${b.attempt}`)),
        h('div', { class: 'small' }, b.reason),
        (b.unmet_requirements || []).length ? h('ul', { class: 'rounds' },
          b.unmet_requirements.map((u) => h('li', null, `${u.requirement_id}: ${u.reason}`))) : null);
    }) : [h('div', { class: 'empty' }, 'no open blockers')]));
  }

  function summary(ev) {
    const d = ev.data || {};
    switch (ev.type) {
      case 'task.created': return d.title;
      case 'task.claimed': return `by ${d.worker}${d.node ? ' on ' + d.node : ''}, attempt ${d.attempt}`;
      case 'task.verdict': return `${d.checker}: ${d.outcome}` + (d.verdicts || []).map((v) => ` · ${v.requirement_id} ${v.verdict}${v.reason ? ' — ' + v.reason : ''}`).join('');
      case 'task.rejected': case 'task.retry_scheduled':
        return d.reason || (d.unmet_requirements || d.rework_notes || []).map((u) => `${u.requirement_id}: ${u.reason}`).join('; ');
      case 'task.blocked': return d.reason;
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
        h('span', { class: 'stream', onclick: kind === 'task' ? () => openTask(id) : null }, ev.stream),
        h('span', { class: 'muted' }, summary(ev) || '')));
    const feed = $('feed');
    feed.prepend(li);
    while (feed.childElementCount > FEED_MAX) feed.lastElementChild.remove();
    $('feed-count').textContent = S.received ? `+${S.received} live` : '';
  }

  // ------------------------------------------------------------ detail + history

  function openTask(id) {
    S.selected = id;
    S.history = { taskId: id, rows: [], active: null, loaded: false, error: null };
    $('detail').hidden = false;
    renderDetail();
    renderBoard();
    loadHistory(id);
  }

  function closeDetail() {
    S.selected = null; S.history = null;
    $('detail').hidden = true;
    renderBoard();
  }

  function kv(pairs) {
    return h('dl', { class: 'kv' }, pairs.filter(([, v]) => v !== null && v !== undefined && v !== '')
      .map(([k, v]) => [h('dt', null, k), h('dd', null, v)]));
  }

  function verdictBlock(v) {
    return h('div', { class: 'verdict', dataset: { checker: v.checker } },
      h('div', null, h('strong', { class: v.outcome }, v.outcome), ` · checker ${v.checker}`,
        v.node ? ` on ${v.node}` : '', v.worker ? ` (${v.worker})` : '', v.category ? ` · ${v.category}` : ''),
      (v.verdicts || []).length ? h('table', null,
        h('tr', null, h('th', null, 'requirement'), h('th', null, 'verdict'), h('th', null, 'reason')),
        v.verdicts.map((r) => h('tr', { class: 'req' }, h('td', { class: 'mono' }, r.requirement_id),
          h('td', { class: r.verdict }, r.verdict), h('td', { class: 'reason' }, r.reason || '—')))) : null);
  }

  function notesTable(notes) {
    return h('table', { class: 'notes' },
      h('tr', null, h('th', null, 'requirement'), h('th', null, 'reason'), h('th', null, 'checker')),
      notes.map((n) => h('tr', null, h('td', { class: 'mono' }, n.requirement_id), h('td', null, n.reason || '—'),
        h('td', null, n.checker || '—'))));
  }

  function stateSections(t) {
    const out = [];
    if ((t.verdicts || []).length) out.push(h('h3', null, 'Verdicts'), t.verdicts.map(verdictBlock));
    else if ((t.previous_verdicts || []).length) {
      out.push(h('h3', null, 'Verdicts of the last judged attempt'), t.previous_verdicts.map(verdictBlock));
    }
    if (t.task_type === 'verify' && t.outcome) {
      out.push(h('h3', null, 'This check'), verdictBlock({ checker: t.checker, outcome: t.outcome,
        verdicts: t.verify_verdicts, node: t.node, worker: t.worker, category: t.category }));
    }
    if ((t.rework_notes || []).length) out.push(h('h3', null, 'Rework notes'), notesTable(t.rework_notes));
    return out;
  }

  function renderDetail() {
    const t = S.tasks.get(S.selected);
    $('detail-title').textContent = t ? t.title : S.selected;
    if (!t) { $('detail-body').replaceChildren(h('p', { class: 'muted' }, 'loading…')); return; }
    const blocker = t.blocker_id ? S.blockers.find((b) => b.id === t.blocker_id) : null;
    const body = [
      kv([
        ['id', h('span', { class: 'mono' }, t.id)], ['state', h('span', { class: 'tag state' }, t.state)],
        ['project', t.project], ['type', t.task_type], ['attempt', `${t.attempt} of ${t.max_attempts}`],
        ['maker', t.maker_node ? `${t.maker_node}${t.maker_worker ? ' (' + t.maker_worker + ')' : ''}` : null],
        ['last node', t.node ? `${t.node}${t.worker ? ' (' + t.worker + ')' : ''}` : null],
        ['checkers', t.verification ? t.verification.checkers.join(', ') : (t.task_type === 'verify' ? t.checker : 'none')],
        ['verifier tasks', (t.verifier_task_ids || []).join(', ')],
        ['parent', t.parent_task_id], ['round', t.is_parent ? t.round : t.subtask_round],
        ['blocker', t.blocker_id ? `${t.blocker_id}${blocker ? ': ' + blocker.reason : ''}` : null],
        ['escalated', t.escalated ? 'yes' : null], ['error', t.error],
        ['updated', t.updated_at], ['seq', t.seq],
      ]),
      (t.requirements || []).length ? [h('h3', null, 'Requirements'), h('table', null,
        t.requirements.map((r) => h('tr', null, h('td', { class: 'mono' }, r.id), h('td', null, r.text))))] : null,
      stateSections(t),
      t.is_parent && (t.rounds || []).length ? [h('h3', null, 'Rounds'),
        h('ul', { class: 'rounds' }, t.rounds.map((r) => h('li', null, roundSummary(r))))] : null,
      h('h3', null, 'History ', h('span', { class: 'muted small' }, '(click a step for the state after it, from the replay API)')),
      historyView(),
    ];
    $('detail-body').replaceChildren(...body.flat(Infinity).filter(Boolean));
  }

  function historyView() {
    const hs = S.history;
    if (!hs) return null;
    if (hs.error) return h('p', { class: 'error' }, hs.error);
    if (!hs.loaded) return h('p', { class: 'muted' }, 'loading history…');
    const table = h('table', { class: 'history' },
      h('tr', null, h('th', null, '#'), h('th', null, 'seq'), h('th', null, 'time'), h('th', null, 'event'),
        h('th', null, 'by'), h('th', null, 'state after')),
      hs.rows.map((row) => {
        const ev = row.event;
        const m = ev.meta || {};
        return h('tr', { class: hs.active === ev.seq ? 'active' : null, dataset: { seq: String(ev.seq), type: ev.type },
          onclick: () => { hs.active = hs.active === ev.seq ? null : ev.seq; renderDetail(); } },
        h('td', null, ev.stream_seq), h('td', { class: 'mono' }, ev.seq), h('td', null, (ev.recorded_at || '').slice(11, 19)),
        h('td', { class: 'type' }, ev.type), h('td', null, `${m.actor || ''}${m.node ? ' @ ' + m.node : ''}`),
        h('td', { class: 'after' }, row.state ? `${row.state.state} · attempt ${row.state.attempt}` : '…'));
      }));
    const active = hs.rows.find((r) => r.event.seq === hs.active);
    return [table, active ? asOfView(active) : null];
  }

  function asOfView(row) {
    const s = row.state;
    return h('div', { class: 'asof', dataset: { seq: String(row.event.seq) } },
      h('div', null, h('strong', null, `As of seq ${row.event.seq}`), ` — after ${row.event.type}`),
      s ? [kv([['state', s.state], ['attempt', s.attempt], ['maker', s.maker_node], ['on', s.node],
        ['blocker', s.blocker_id], ['verifier tasks', (s.verifier_task_ids || []).join(', ')]]), stateSections(s)]
        : h('p', { class: 'muted' }, 'loading…'),
      h('h3', null, 'Event data'), h('pre', { class: 'mono' }, JSON.stringify(row.event.data, null, 2)));
  }

  async function loadHistory(id) {
    const hs = S.history;
    try {
      const events = [];
      let since = 0;
      for (;;) {
        const page = await api(`/tasks/${encodeURIComponent(id)}/events?since_seq=${since}&limit=1000`);
        events.push(...page.events);
        if (page.events.length < 1000) break;
        since = page.next_seq;
      }
      if (S.history !== hs) return;
      const known = new Set(hs.rows.map((r) => r.event.seq));
      hs.rows = [...events.filter((e) => !known.has(e.seq)).map((event) => ({ event, state: null })), ...hs.rows]
        .sort((a, b) => a.event.seq - b.event.seq);
      hs.loaded = true;
      renderDetail();
      await replayStates(hs);
    } catch (e) {
      if (e instanceof Unauthorized) return signedOut(e.message);
      if (S.history === hs) { hs.error = 'history: ' + e.message; renderDetail(); }
    }
  }

  // The state after each event, from GET /tasks/{id}?as_of_seq=N (a few at a time).
  async function replayStates(hs) {
    const todo = hs.rows.filter((r) => !r.state && !r.loading);
    for (const r of todo) r.loading = true;
    let i = 0;
    const worker = async () => {
      while (i < todo.length && S.history === hs) {
        const row = todo[i++];
        row.state = await api(`/tasks/${encodeURIComponent(hs.taskId)}?as_of_seq=${row.event.seq}`);
      }
    };
    await Promise.all([worker(), worker(), worker(), worker()]);
    if (S.history === hs) renderDetail();
  }

  function appendHistory(ev) {
    const hs = S.history;
    if (hs.rows.some((r) => r.event.seq === ev.seq)) return;
    hs.rows.push({ event: ev, state: null });
    hs.rows.sort((a, b) => a.event.seq - b.event.seq);
    if (hs.loaded) replayStates(hs).catch(() => {});
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
  $('detail-close').addEventListener('click', closeDetail);
  document.addEventListener('keydown', (e) => { if (e.key === 'Escape' && S.selected) closeDetail(); });
  $('show-verify').addEventListener('change', renderBoard);

  (async () => {
    try {
      start(await api('/ui/session'));
    } catch (e) {
      showSignin(e instanceof Unauthorized ? '' : 'The service is not reachable: ' + e.message);
    }
  })();
})();
