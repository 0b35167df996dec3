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

  // Each table cell carries its column's heading as data-label, which a phone's stacked rows
  // show before the value (app.css, "A phone"). A cell that already has one keeps it; a
  // colspan cell takes its first column's heading. Run on load and after every htmx swap,
  // since a swap may bring rows in without their table.
  function labelCells() {
    document.querySelectorAll("main table").forEach((table) => {
      const heads = [];
      table.querySelectorAll(":scope > thead > tr:first-child > th").forEach((th) => {
        const span = Number(th.getAttribute("colspan") || 1);
        for (let i = 0; i < span; i += 1) heads.push(th.textContent.trim());
      });
      if (!heads.length) return;
      table.querySelectorAll(":scope > tbody > tr").forEach((row) => {
        let column = 0;
        Array.from(row.children).forEach((cell) => {
          if (!cell.hasAttribute("data-label") && !cell.hasAttribute("colspan")) {
            cell.setAttribute("data-label", heads[column] || "");
          }
          column += Number(cell.getAttribute("colspan") || 1);
        });
      });
    });
  }
  document.addEventListener("DOMContentLoaded", labelCells);
  document.addEventListener("htmx:load", labelCells);

  // data-fold-narrow: a <details> that starts folded on a phone (a long section, such as one
  // part of the Settings page's configuration) and open on a wider screen.
  document.addEventListener("DOMContentLoaded", () => {
    if (!window.matchMedia("(max-width: 720px)").matches) return;
    document.querySelectorAll("details[data-fold-narrow]").forEach((d) => { d.open = false; });
  });

  // data-copy: a button that copies the text of the element its value names (by id) to the
  // clipboard and says so on itself; selecting the text first keeps a manual copy possible
  // where the clipboard is refused (plain HTTP on another host).
  document.addEventListener("click", (event) => {
    const button = event.target instanceof Element
      ? event.target.closest("button[data-copy]") : null;
    if (!button) return;
    const source = document.getElementById(button.getAttribute("data-copy") || "");
    if (!source) return;
    const text = "value" in source ? source.value : source.textContent;
    if ("select" in source) source.select();
    const said = () => { button.textContent = "Copied"; };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(said, () => { button.textContent = "Selected: press Ctrl+C"; });
    } else {
      button.textContent = "Selected: press Ctrl+C";
    }
  });

  // data-reset-when="SELECTOR": a form emptied once its request brought SELECTOR in (the
  // create-key form, once the new key is shown), so the next one starts blank; a refusal
  // brings no such element and keeps what was typed.
  document.addEventListener("htmx:afterSwap", (event) => {
    const config = event.detail.requestConfig;
    const form = config && config.elt ? config.elt : event.detail.elt;
    if (!(form instanceof HTMLFormElement) || !form.hasAttribute("data-reset-when")) return;
    if (document.querySelector(form.getAttribute("data-reset-when"))) form.reset();
  });

  // data-select-on-click: selected again on each click, so a copy takes all of it.
  document.addEventListener("click", (event) => {
    const element = event.target instanceof Element
      ? event.target.closest("[data-select-on-click]") : null;
    if (element) element.select();
  });
})();
