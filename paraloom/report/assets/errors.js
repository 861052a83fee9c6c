// Loaded first: every script error and console.error of the page is kept in window.__errors and
// shown in #load-errors at the end of loading (a headless browser's DOM dump then carries them).
window.__errors = [];
window.addEventListener("error", function (e) {
  window.__errors.push("error: " + e.message + " at " + e.filename + ":" + e.lineno);
});
window.addEventListener("unhandledrejection", function (e) {
  window.__errors.push("unhandled rejection: " + e.reason);
});
(function () {
  var original = console.error;
  console.error = function () {
    window.__errors.push("console.error: " + Array.prototype.join.call(arguments, " "));
    return original.apply(console, arguments);
  };
})();
