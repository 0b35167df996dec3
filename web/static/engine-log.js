// Live engine log on the Engine page: server-sent events from /api/v1/engine/log/stream,
// after the last lines from /api/v1/engine/log. Filters (rank, level) reconnect the stream.
(function () {
  "use strict";
  const box = document.getElementById("engine-log");
  const form = document.getElementById("log-filters");
  if (!box || !form) return;
  const MAX_LINES = 2000;
  let source = null;
  let generation = 0; // a newer connect() wins over one still waiting for its tail

  function query() {
    const params = new URLSearchParams();
    for (const field of ["rank", "level"]) {
      const value = form.elements[field].value;
      if (value) params.set(field, value);
    }
    return params.toString();
  }

  function append(line) {
    // Follow the end only while the reader is there; scrolled up, the view stays put.
    const following = box.scrollHeight - box.scrollTop - box.clientHeight < 24;
    box.append(line + "\n");
    while (box.childNodes.length > MAX_LINES) box.removeChild(box.firstChild);
    if (following) box.scrollTop = box.scrollHeight;
  }

  async function connect() {
    const mine = ++generation;
    if (source) source.close();
    source = null;
    box.textContent = "";
    const q = query();
    try {
      const recent = await fetch(box.dataset.source + "?lines=200" + (q ? "&" + q : ""));
      const lines = recent.ok ? (await recent.json()).lines : [];
      if (mine !== generation) return;
      lines.forEach(append);
    } catch (error) {
      // No tail (daemon restarting, network): the stream below still brings new lines.
    }
    if (mine !== generation) return;
    source = new EventSource(box.dataset.source + "/stream" + (q ? "?" + q : ""));
    source.onmessage = (event) => append(event.data);
  }

  form.addEventListener("change", connect);
  window.addEventListener("pagehide", () => { if (source) source.close(); });
  window.addEventListener("pageshow", (event) => { if (event.persisted) connect(); });
  connect();
})();
