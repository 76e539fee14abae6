// The matrix's Node.js server: node's own `https` module (the OpenSSL linked
// into the node binary) streaming OpenAI chat-completions SSE, one write per chunk.
// A request with "burst": true gets its chunks without pauses (llm_script.py's
// rule): node then gathers them into vectored writes.
// Run: node node_sse.js PORT CERT KEY
"use strict";
const fs = require("fs");
const https = require("https");

const [port, cert, key] = process.argv.slice(2);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function chat(req, res, body) {
  const request = JSON.parse(body);
  const words = (request.messages || []).map((m) => m.content).join(" ").split(/\s+/).filter(Boolean);
  const prompt = Math.max(1, words.length);
  const tokens = request.max_tokens;
  const id = `chatcmpl-node-${process.hrtime.bigint()}`;
  res.writeHead(200, { "Content-Type": "text/event-stream" });
  const send = async (obj) => {
    res.write(`data: ${JSON.stringify({ id, object: "chat.completion.chunk", model: request.model, ...obj })}\n\n`);
    if (!request.burst) await sleep(10); // llm_script.py's FRAME_GAP_S
  };
  const choice = (delta, finish) => ({ choices: [{ index: 0, delta, finish_reason: finish }] });
  await send(choice({ role: "assistant", content: "" }, null));
  for (let i = 0; i < tokens; i++) await send(choice({ content: ` tok${i}` }, null));
  await send(choice({}, "length"));
  if ((request.stream_options || {}).include_usage) {
    await send({ choices: [], usage: { prompt_tokens: prompt, completion_tokens: tokens, total_tokens: prompt + tokens } });
  }
  res.end("data: [DONE]\n\n");
}

https.createServer({ cert: fs.readFileSync(cert), key: fs.readFileSync(key) }, (req, res) => {
  let body = "";
  req.on("data", (part) => { body += part; });
  req.on("end", () => {
    if (req.method !== "POST" || req.url !== "/v1/chat/completions") {
      res.writeHead(404).end();
      return;
    }
    chat(req, res, body);
  });
}).listen(Number(port), "127.0.0.1");
