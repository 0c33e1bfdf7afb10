// Asyncflow dashboard: progressive enhancement only; every page works without it.
//  - <body data-refresh="ms">: reload the page's [data-live] parts in place while it is open
//    (stops when the fresh page no longer asks for it, e.g. once a task has ended).
//  - <input data-select-all="name">: ticks every checkbox of that name.
"use strict";

(function () {
  function refreshLoop(delay) {
    window.setTimeout(async function () {
      if (document.hidden) { refreshLoop(delay); return; }
      let next = null;
      try {
        const answer = await fetch(window.location.href, { credentials: "same-origin", headers: { "X-Refresh": "1" } });
        if (answer.ok && (answer.headers.get("content-type") || "").startsWith("text/html")) {
          const fresh = new DOMParser().parseFromString(await answer.text(), "text/html");
          document.querySelectorAll("[data-live][id]").forEach(function (old) {
            const replacement = fresh.getElementById(old.id);
            if (replacement) { old.replaceWith(document.importNode(replacement, true)); }
          });
          next = fresh.body.dataset.refresh;
          if (!next) { delete document.body.dataset.refresh; }
        } else {
          next = delay; // a hiccup (restart, 503): try again
        }
      } catch (e) {
        next = delay;
      }
      if (next) { refreshLoop(Number(next)); }
    }, delay);
  }

  document.addEventListener("change", function (event) {
    const box = event.target;
    if (box.dataset && box.dataset.selectAll) {
      document.querySelectorAll('input[type=checkbox][name="' + box.dataset.selectAll + '"]').forEach(function (b) {
        b.checked = box.checked;
      });
    }
  });

  document.addEventListener("submit", function (event) {
    const button = event.submitter;
    if (button && button.classList.contains("warn") && !window.confirm(button.textContent.trim() + "?")) {
      event.preventDefault();
    }
  });

  const delay = Number(document.body.dataset.refresh);
  if (delay > 0) { refreshLoop(delay); }
})();
