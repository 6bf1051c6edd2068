// sa_outbox dashboard: small progressive enhancement. Every page works without it.
(function () {
  "use strict";

  // Ask before an action (buttons and forms carrying data-confirm).
  document.addEventListener("submit", function (event) {
    var button = event.submitter;
    var message = (button && button.getAttribute("data-confirm")) || event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) event.preventDefault();
  });

  // Select all / the number selected; buttons that need a selection wait for one.
  function updateSelection(form) {
    var boxes = form.querySelectorAll('input[type="checkbox"][name="ids"]');
    var n = 0;
    boxes.forEach(function (b) { if (b.checked) n += 1; });
    form.querySelectorAll("[data-selected-count]").forEach(function (el) {
      el.textContent = n ? n + " selected" : "";
    });
    form.querySelectorAll("[data-needs-selection]").forEach(function (el) { el.disabled = n === 0; });
  }
  document.querySelectorAll("form").forEach(function (form) {
    if (!form.querySelector('input[name="ids"][type="checkbox"]')) return;
    updateSelection(form);
    form.addEventListener("change", function (event) {
      var all = event.target.closest("[data-select-all]");
      if (all) form.querySelectorAll('input[type="checkbox"][name="ids"]').forEach(function (b) { b.checked = all.checked; });
      updateSelection(form);
    });
  });

  // Copy a doctor fix.
  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (!button || !navigator.clipboard) return;
    var pre = button.parentElement.querySelector("pre");
    navigator.clipboard.writeText(pre.textContent).then(function () {
      button.textContent = "copied";
      setTimeout(function () { button.textContent = "copy"; }, 1500);
    });
  });

  // Refresh the overview in place while the tab is visible.
  var toggle = document.querySelector("[data-auto-refresh]");
  if (toggle) {
    var seconds = parseInt(toggle.getAttribute("data-auto-refresh"), 10) || 10;
    setInterval(function () {
      if (!toggle.checked || document.hidden) return;
      fetch(window.location.href, { credentials: "same-origin", headers: { "Accept": "text/html" } })
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (!html) return;
          var fresh = new DOMParser().parseFromString(html, "text/html");
          var live = document.getElementById("live"), freshLive = fresh.getElementById("live");
          if (live && freshLive) live.replaceWith(freshLive);
          var foot = document.querySelector("footer"), freshFoot = fresh.querySelector("footer");
          if (foot && freshFoot) foot.replaceWith(freshFoot);
        })
        .catch(function () {});
    }, seconds * 1000);
  }
})();
