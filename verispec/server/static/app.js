// The playground: streams /v1/chat/completions and paints each token by its fate, from the
// `verispec` field of every chunk ({tokens, fates, rejected, drafted}; the last one's `summary`).
"use strict";

const $ = (selector, root = document) => root.querySelector(selector);

async function loadMethods() {
  const models = await (await fetch("/v1/models")).json();
  const info = models.data[0].verispec;
  const select = $("#method");
  for (const method of info.methods) {
    select.add(new Option(method, method, false, method === info.default_method));
  }
  return models.data[0].id;
}

function token(text, cls, tag = "span") {
  const node = document.createElement(tag);
  node.className = `tok ${cls}`;
  node.textContent = text;
  return node;
}

// One streamed answer into one pane; resolves with the server's summary.
async function run(pane, model, method, prompt, maxTokens, format) {
  const out = $(".output", pane);
  out.textContent = "";
  $(".title", pane).textContent = method === "ar" ? "plain decoding (ar)" : `speculative: ${method}`;
  for (const cls of [".tau", ".tps"]) $(cls, pane).textContent = "–";
  $(".count", pane).textContent = "0";
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: {"Content-Type": "application/json"},
    body: JSON.stringify({model, method, stream: true, temperature: 0, max_tokens: maxTokens,
                          response_format: format,
                          messages: [{role: "user", content: prompt}]}),
  });
  if (!response.ok) throw new Error((await response.json()).error.message);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const started = performance.now();
  let buffer = "", tokens = 0, steps = 0, summary = null;
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const extra = chunk.verispec;
      if (!extra) continue;
      steps += 1;
      extra.tokens.forEach((piece, i) => {
        if (extra.rejected[i]) out.append(token(extra.rejected[i], "rejected", "s"));
        out.append(token(piece, extra.drafted ? extra.fates[i] : "plain"));
      });
      tokens += extra.tokens.length;
      const seconds = (performance.now() - started) / 1000;
      $(".tau", pane).textContent = (tokens / steps).toFixed(2);
      $(".tps", pane).textContent = (tokens / seconds).toFixed(1);
      $(".count", pane).textContent = tokens;
      if (extra.summary) summary = extra.summary;
    }
  }
  if (summary) $(".tau", pane).textContent = summary.mean_accepted_tokens.toFixed(2);
  return summary;
}

async function main() {
  const model = await loadMethods();
  $("#ask").addEventListener("submit", async (event) => {
    event.preventDefault();
    const button = $("#go"), error = $("#error");
    button.disabled = true;
    error.hidden = true;
    document.body.dataset.state = "running";
    const prompt = $("#prompt").value, maxTokens = Number($("#max-tokens").value);
    try {
      const format = {type: $("#format").value};
      if (format.type === "json_schema") {
        let schema;
        try { schema = JSON.parse($("#schema").value); } catch (bad) {
          throw new Error(`the schema is not valid JSON: ${bad.message}`);
        }
        format.json_schema = {name: "playground", schema};
      }
      // One after the other, so each gets the machine to itself and the speeds compare.
      await run($("#spec"), model, $("#method").value, prompt, maxTokens, format);
      if ($("#compare").checked) await run($("#plain"), model, "ar", prompt, maxTokens, format);
    } catch (failure) {
      error.textContent = failure.message;
      error.hidden = false;
    } finally {
      button.disabled = false;
      document.body.dataset.state = "done";
    }
  });
}

$("#format").addEventListener("change", () => { $("#schema").hidden = $("#format").value !== "json_schema"; });
main();
