// Draws the site's diagrams (```mermaid blocks, rendered as <div class="diagram">) with the
// mermaid that docs/hooks/mermaid.py puts beside this file in the built site (MIT, from the
// npm registry, checked by its sha512): the site loads nothing from elsewhere. Each diagram's
// SVG goes inside its own div.
document.addEventListener("DOMContentLoaded", function () {
  if (typeof mermaid === "undefined" || !document.querySelector("div.diagram")) {
    return;
  }
  mermaid.initialize({ startOnLoad: false, securityLevel: "strict" });
  mermaid.run({ querySelector: "div.diagram" });
});
