/**
 * Integration tests: the client against a real hotloop-serve (Ray Serve's gRPC proxy, a
 * replica, llama.cpp, the bundled Gemma 3 270M), started once for this file on loopback
 * (see test/server.ts; HOTLOOP_ADDRESS uses a running server instead).
 */

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  Cancelled,
  type Chunk,
  Client,
  type Message,
  InvalidArgument,
  NotFound,
  Role,
  type Settings,
} from "../src";
import { MODEL, type RunningServer, startServer } from "./server";

const GREEDY: Settings = { temperature: 0, sampleLen: 16 };
const HISTORY: Message[] = [
  { role: Role.SYSTEM, content: "You are a helpful assistant." },
  { role: Role.USER, content: "Name three colours." },
];

async function collect(stream: AsyncIterable<Chunk>): Promise<Chunk[]> {
  const out: Chunk[] = [];
  for await (const chunk of stream) out.push(chunk);
  return out;
}

const text = (chunks: Chunk[]): string => chunks.map((c) => c.text).join("");

describe(`hotloop-serve on loopback (${MODEL})`, () => {
  let server: RunningServer | undefined;
  let client: Client;

  before(
    async () => {
      server = await startServer();
      client = new Client(server.address);
      console.log(`hotloop-serve serving on ${server.address} after ${server.startupS.toFixed(1)} s`);
    },
    { timeout: 330_000 },
  );

  after(
    async () => {
      client?.close();
      const t0 = Date.now();
      await server?.stop();
      if (server?.startupS) console.log(`hotloop-serve stopped in ${((Date.now() - t0) / 1000).toFixed(1)} s`);
    },
    { timeout: 90_000 },
  );

  test("listModels (through ListApplications) and model.info()", async () => {
    assert.ok((await client.applicationNames()).includes(MODEL));
    const models = await client.listModels();
    assert.ok(
      models.some((m) => m.name === MODEL),
      JSON.stringify(models),
    );
    const info = await client.model(MODEL).info();
    assert.equal(info.name, MODEL);
    assert.equal(info.architecture, "gemma3");
    // The server's configured session context: known when this file started the server,
    // otherwise (HOTLOOP_ADDRESS) whatever that server says, consistently in both RPCs.
    assert.ok(info.contextLength > 0);
    assert.equal(info.contextLength, models.find((m) => m.name === MODEL)?.contextLength);
    if (server?.sessionContextTokens !== undefined) assert.equal(info.contextLength, server.sessionContextTokens);
    assert.ok(info.parameters > 0 && info.sizeBytes > 0 && info.vocabSize > 0);
    const tokens = await client.model(MODEL).tokenize("Hello world");
    assert.ok(tokens.length >= 2);
  });

  test("streams a reply; the second turn reuses the first from the hot cache", async () => {
    const session = await client.model(MODEL).newSession({ settings: GREEDY });
    assert.ok(session.id);
    assert.equal(session.settings.sampleLen, 16);
    assert.equal(session.settings.temperature, 0);

    const first = await collect(session.generate(HISTORY));
    assert.ok(first.length > 1, "streamed in several chunks");
    const last1 = first.at(-1);
    assert.ok(last1?.isLast && last1.usage && last1.finishReason && last1.servedBy?.replica);
    const reply = text(first);
    assert.ok(reply.length > 0);
    assert.ok(last1.usage.completionTokens <= 16);
    assert.equal(last1.usage.prefilledTokens + last1.usage.cachedTokens, last1.usage.promptTokens);

    const history: Message[] = [
      ...HISTORY,
      { role: "assistant", content: reply },
      { role: "user", content: "And three animals?" },
    ];
    const second = await collect(session.generate(history));
    const u2 = second.at(-1)?.usage;
    assert.ok(u2);
    assert.ok(
      u2.cachedTokens >= last1.usage.promptTokens,
      `cached ${u2.cachedTokens} < first turn's prompt ${last1.usage.promptTokens}`,
    );
    assert.equal(u2.cachedTokens + u2.prefilledTokens, u2.promptTokens);
    assert.ok((await session.context()) >= u2.promptTokens);

    // Greedy is deterministic: a fresh session gives the same first reply.
    const again = await client.model(MODEL).newSession({ settings: GREEDY });
    assert.equal(text(await collect(again.generate(HISTORY))), reply);
    await again.close();
    await session.close();
  });

  test("warmup, context, setSettings, clearCache, close", async () => {
    const session = await client.model(MODEL).newSession({ settings: GREEDY });
    const system: Message = { role: "system", content: "Always answer in JSON." };
    const usage = await session.warmup([system]);
    assert.ok(usage.prefilledTokens > 0);
    assert.equal(usage.completionTokens, 0);
    assert.equal(await session.context(), usage.promptTokens);

    const out = await collect(session.generate([system, ["user", "Hi"]], { sampleLen: 4 }));
    const u = out.at(-1)?.usage;
    assert.ok(u && u.cachedTokens >= usage.promptTokens - 1 && u.completionTokens <= 4);

    await session.clearCache();
    assert.equal(await session.context(), 0);

    const settings = await session.setSettings({ temperature: 0, sampleLen: 3 });
    assert.equal(settings.sampleLen, 3);
    assert.equal((await session.info()).settings.sampleLen, 3);
    const capped = await collect(session.generate([["user", "Count to ten."]]));
    assert.ok((capped.at(-1)?.usage?.completionTokens ?? 99) <= 3);

    await session.close();
    await session.close(); // idempotent
    await assert.rejects(session.context(), NotFound);
  });

  test("an AbortSignal cancels a reply midway", async () => {
    const session = await client.model(MODEL).newSession({ settings: { temperature: 0, sampleLen: 200 } });
    const controller = new AbortController();
    const seen: Chunk[] = [];
    await assert.rejects(
      (async () => {
        for await (const chunk of session.generate([["user", "Write a long story about the sea."]], {
          signal: controller.signal,
        })) {
          seen.push(chunk);
          if (seen.length === 2) controller.abort();
        }
      })(),
      Cancelled,
    );
    assert.equal(seen.length, 2);
    assert.ok(!seen.some((c) => c.isLast), "cancelled before the end");
    // The session is free again for the next turn (the server let go of the cancelled one).
    let after: Chunk[] = [];
    for (let i = 0; i < 20; i++) {
      try {
        after = await collect(session.generate([["user", "Hi"]], { sampleLen: 4 }));
        break;
      } catch (err) {
        if (!(err instanceof Error && err.name === "FailedPrecondition")) throw err;
        await new Promise((r) => setTimeout(r, 250)); // still winding down the cancelled turn
      }
    }
    assert.ok(after.at(-1)?.isLast);
    await session.close();
  });

  test("fork then diverge; list; export then import: same greedy text, cache reused", async () => {
    const model = client.model(MODEL);
    const settings: Settings = { temperature: 0, sampleLen: 12, repeatPenalty: 1 };
    const fresh = async (history: Message[]): Promise<string> => {
      const session = await model.newSession({ settings });
      try {
        return text(await collect(session.generate(history)));
      } finally {
        await session.close();
      }
    };
    const base: Message[] = [
      { role: "system", content: "You are a helpful assistant." },
      { role: "user", content: "Tell me a fact about the sea." },
      { role: "assistant", content: "The sea is salty." },
    ];
    const source = await model.newSession({ settings });
    await collect(source.generate([...base, { role: "user", content: "One more?" }]));
    const fork = await source.fork(base); // the cache up to the end of `base`
    const kept = await fork.context();
    assert.ok(kept > 0 && kept < (await source.context()), `kept ${kept}`);
    assert.equal(fork.settings.sampleLen, 12);

    const left: Message[] = [...base, { role: "user", content: "Now about rivers." }];
    const right: Message[] = [...base, { role: "user", content: "Now about mountains." }];
    const a = await collect(source.generate(left));
    const b = await collect(fork.generate(right));
    assert.equal(b.at(-1)?.usage?.cachedTokens, kept, "the fork's first turn reuses the copied cache");
    assert.equal(text(a), await fresh(left));
    assert.equal(text(b), await fresh(right));

    // Listing is per principal: this server has no auth, and an anonymous caller's sessions are
    // each their own tenant, which a list may not show; what is listed must be right.
    const listed = new Map((await model.listSessions()).map((s) => [s.id, s]));
    if (listed.size > 0) {
      assert.ok(listed.has(source.id) && listed.has(fork.id), JSON.stringify([...listed.keys()]));
      assert.ok((listed.get(fork.id)?.contextTokens ?? 0) > kept);
      assert.ok((listed.get(fork.id)?.lastUsed ?? 0) > 0);
    }

    const blob = await fork.export();
    assert.ok(blob.length > 1000);
    const follow: Message[] = [
      ...right,
      { role: "assistant", content: text(b) },
      { role: "user", content: "And then?" },
    ];
    const expected = await collect(fork.generate(follow));
    const imported = await model.importSession(blob, settings);
    assert.notEqual(imported.id, fork.id);
    const got = await collect(imported.generate(follow));
    const [gu, eu] = [got.at(-1)?.usage, expected.at(-1)?.usage];
    assert.ok(gu && eu && eu.cachedTokens > 0);
    assert.equal(gu.cachedTokens, eu.cachedTokens, "the imported cache is reused like the original");
    assert.equal(text(got), text(expected));

    const damaged = new Uint8Array(blob);
    const at = Math.floor(blob.length / 3);
    damaged[at] = (damaged[at] ?? 0) ^ 1;
    await assert.rejects(model.importSession(damaged), InvalidArgument);
    await assert.rejects(model.importSession(blob.subarray(0, blob.length - 10)), InvalidArgument);
    for (const s of [source, fork, imported]) await s.close();
  });

  test("structured output (jsonSchema) and logprobs", async () => {
    const schema = {
      type: "object",
      properties: { name: { type: "string" }, age: { type: "integer" } },
      required: ["name", "age"],
    };
    const settings: Settings = {
      temperature: 0,
      sampleLen: 48,
      jsonSchema: JSON.stringify(schema),
      logprobs: true,
      topLogprobs: 2,
    };
    const session = await client.model(MODEL).newSession({ settings });
    const chunks = await collect(session.generate([["user", "Describe a person named Ann, aged 31, as JSON."]]));
    const reply = JSON.parse(text(chunks)) as { name: unknown; age: unknown };
    assert.equal(typeof reply.name, "string");
    assert.ok(Number.isInteger(reply.age));
    const tokens = chunks.flatMap((c) => [...c.logprobs]);
    assert.equal(Buffer.concat(tokens.map((t) => Buffer.from(t.piece))).toString("utf8"), text(chunks));
    assert.ok(tokens.every((t) => t.logprob <= 0 && t.top.length === 2));
    await assert.rejects(
      collect(session.generate([["user", "x"]], { jsonSchema: '{"type": "nonsense"}' })),
      (err: Error) => err instanceof InvalidArgument && /json_schema is not supported/.test(err.message),
    );
    await session.close();
  });

  test("errors: unknown session is NotFound, bad settings are InvalidArgument", async () => {
    const unknown = client.model(MODEL).session("no-such-session.id");
    await assert.rejects(collect(unknown.generate(HISTORY)), NotFound);
    await assert.rejects(unknown.context(), NotFound);

    const session = await client.model(MODEL).newSession({ settings: GREEDY });
    await assert.rejects(collect(session.generate(HISTORY, { temperature: -1 })), (err: unknown) => {
      assert.ok(err instanceof InvalidArgument, String(err));
      assert.match(err.details, /temperature/);
      return true;
    });
    await assert.rejects(client.model(MODEL).newSession({ settings: { topP: 1.5 } }), InvalidArgument);
    // Still serving after the errors.
    assert.ok((await collect(session.generate(HISTORY))).at(-1)?.usage);
    await session.close();
  });
});
