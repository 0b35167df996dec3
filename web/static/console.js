// Console behaviour that would otherwise sit in attributes. The console's
// Content-Security-Policy (appliance/edge.py) runs scripts from /static only, with no eval,
// so there is no hx-on or onclick in the templates: they mark elements with data- attributes
// and this file acts on them.
(function () {
  "use strict";

  // data-select-on-load: selected (and focused) once htmx has brought it in, e.g. a new API
  // key shown once, ready to copy.
  document.addEventListener("htmx:load", (event) => {
    const root = event.detail.elt;
    if (!(root instanceof Element)) return;
    const marked = root.matches("[data-select-on-load]")
      ? [root] : root.querySelectorAll("[data-select-on-load]");
    marked.forEach((element) => { element.focus(); element.select(); });
  });

  // data-select-on-click: selected again on each click, so a copy takes all of it.
  document.addEventListener("click", (event) => {
    const element = event.target instanceof Element
      ? event.target.closest("[data-select-on-click]") : null;
    if (element) element.select();
  });
})();
