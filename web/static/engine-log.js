// Live engine log on the Engine page: server-sent events from /api/v1/engine/log/stream,
// after the last lines from /api/v1/engine/log. Filters (rank, level) reconnect the stream.
(function () {
  "use strict";
  const box = document.getElementById("engine-log");
  const form = document.getElementById("log-filters");
  if (!box || !form) return;
  const MAX_LINES = 2000;
  let source = null;

  function query() {
    const params = new URLSearchParams();
    for (const field of ["rank", "level"]) {
      const value = form.elements[field].value;
      if (value) params.set(field, value);
    }
    return params.toString();
  }

  function append(line) {
    box.append(line + "\n");
    while (box.childNodes.length > MAX_LINES) box.removeChild(box.firstChild);
    box.scrollTop = box.scrollHeight;
  }

  async function connect() {
    if (source) source.close();
    box.textContent = "";
    const q = query();
    const recent = await fetch(box.dataset.source + "?lines=200" + (q ? "&" + q : ""));
    if (recent.ok) (await recent.json()).lines.forEach(append);
    source = new EventSource(box.dataset.source + "/stream" + (q ? "?" + q : ""));
    source.onmessage = (event) => append(event.data);
  }

  form.addEventListener("change", connect);
  connect();
})();
