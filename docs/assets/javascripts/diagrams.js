// Draws the site's diagrams (```mermaid blocks, rendered as <div class="diagram">) with the
// mermaid bundled beside this file (mermaid-11.17.2.min.js, MIT, mermaid-LICENSE.txt): the
// site loads nothing from elsewhere. Each diagram's SVG goes inside its own div.
document.addEventListener("DOMContentLoaded", function () {
  if (typeof mermaid === "undefined" || !document.querySelector("div.diagram")) {
    return;
  }
  mermaid.initialize({ startOnLoad: false, securityLevel: "strict" });
  mermaid.run({ querySelector: "div.diagram" });
});
