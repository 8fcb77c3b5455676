// Copies the built browser files of the npm dependencies into dashboard/static/dashboard/vendor/.
// The copies are committed, so the service never needs npm or a CDN at run time.
// Usage: cd dashboard/frontend && npm ci && npm run build
import { copyFileSync, mkdirSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const vendor = join(here, "..", "static", "dashboard", "vendor");
const files = [
  ["cytoscape", "dist/cytoscape.min.js", "cytoscape.min.js"],
  ["uplot", "dist/uPlot.iife.min.js", "uPlot.iife.min.js"],
  ["uplot", "dist/uPlot.min.css", "uPlot.min.css"],
  ["cytoscape", "LICENSE", "LICENSE.cytoscape"],
  ["uplot", "LICENSE", "LICENSE.uplot"],
];

mkdirSync(vendor, { recursive: true });
const versions = {};
for (const [pkg, src, dest] of files) {
  const root = join(here, "node_modules", pkg);
  copyFileSync(join(root, src), join(vendor, dest));
  versions[pkg] = JSON.parse(readFileSync(join(root, "package.json"), "utf8")).version;
}
console.log(`copied ${files.length} files to ${vendor}:`, versions);
