// Behaviour the console's pages used to carry in on* attributes: the Content-Security-Policy
// runs no inline script, so elements opt in with data attributes and this file wires them.
(function () {
  "use strict";
  function wire(root) {
    root.querySelectorAll("[data-select-on-focus]").forEach(function (input) {
      input.addEventListener("focus", function () { input.select(); });
    });
    root.querySelectorAll("[data-submit-on-change]").forEach(function (select) {
      select.addEventListener("change", function () { select.form.requestSubmit(); });
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { wire(document); });
  } else {
    wire(document);
  }
})();
