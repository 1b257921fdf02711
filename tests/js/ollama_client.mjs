// The ollama JavaScript client against a running corral server (CORRAL_URL).
//
//   CORRAL_URL=http://127.0.0.1:11434 node tests/js/ollama_client.mjs chat embed ...
//
// Runs the named scenarios one after another and prints one JSON object on stdout:
// {"<scenario>": <summary>} where a summary is what the client returned, reduced to what the
// Python side asserts on, or {"error": message, "status_code": n, "name": ...} when the
// client threw. Driven by tests/test_clients.py.

import { Ollama } from 'ollama'

const SMOL = 'smollm2:135m'
const GREEDY = { temperature: 0, seed: 1 }
const WEATHER = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather in a city',
    parameters: {
      type: 'object',
      properties: { city: { type: 'string', enum: ['Paris', 'London'] } },
      required: ['city'],
    },
  },
}

const host = process.env.CORRAL_URL
if (!host) {
  console.error('CORRAL_URL is not set')
  process.exit(2)
}
const ollama = new Ollama({ host })

const final = (r) => ({
  done: r.done,
  done_reason: r.done_reason,
  eval_count: r.eval_count,
  prompt_eval_count: r.prompt_eval_count,
  total_duration: r.total_duration,
  eval_duration: r.eval_duration,
  model: r.model,
  created_at: r.created_at,
})

async function collect(stream) {
  const chunks = []
  for await (const chunk of stream) chunks.push(chunk)
  return chunks
}

const scenarios = {
  async version() {
    return await ollama.version()
  },

  async chat() {
    const r = await ollama.chat({
      model: SMOL,
      messages: [{ role: 'user', content: 'Say hello.' }],
      options: { ...GREEDY, num_predict: 8 },
    })
    return { ...final(r), role: r.message.role, content: r.message.content }
  },

  async chat_stream() {
    const chunks = await collect(
      await ollama.chat({
        model: SMOL,
        messages: [{ role: 'user', content: 'Count to five.' }],
        stream: true,
        options: { ...GREEDY, num_predict: 8 },
      }),
    )
    return {
      count: chunks.length,
      text: chunks.map((c) => c.message.content).join(''),
      dones: chunks.map((c) => c.done),
      roles: [...new Set(chunks.map((c) => c.message.role))],
      last: final(chunks[chunks.length - 1]),
    }
  },

  async generate() {
    const r = await ollama.generate({
      model: SMOL,
      prompt: 'The capital of France is',
      context: [], // corral sends `context` back to requests that carry one
      options: { ...GREEDY, num_predict: 6 },
    })
    return { ...final(r), response: r.response, context_length: (r.context || []).length }
  },

  async generate_stream() {
    const chunks = await collect(
      await ollama.generate({
        model: SMOL,
        prompt: 'Name a colour.',
        stream: true,
        options: { ...GREEDY, num_predict: 6 },
      }),
    )
    return {
      count: chunks.length,
      text: chunks.map((c) => c.response).join(''),
      dones: chunks.map((c) => c.done),
      last: final(chunks[chunks.length - 1]),
    }
  },

  async embed() {
    const r = await ollama.embed({ model: 'embed', input: ['first text', 'second text'] })
    const norms = r.embeddings.map((v) => Math.sqrt(v.reduce((s, x) => s + x * x, 0)))
    return {
      model: r.model,
      count: r.embeddings.length,
      dims: r.embeddings.map((v) => v.length),
      norms,
      differ: JSON.stringify(r.embeddings[0]) !== JSON.stringify(r.embeddings[1]),
      prompt_eval_count: r.prompt_eval_count,
    }
  },

  async list() {
    const r = await ollama.list()
    return {
      names: r.models.map((m) => m.name),
      models: r.models.map((m) => ({
        name: m.name,
        model: m.model,
        size: m.size,
        digest: m.digest,
        format: m.details && m.details.format,
        family: m.details && m.details.family,
        modified_at: m.modified_at,
        ...(m.error === undefined ? {} : { error: m.error }),
      })),
    }
  },

  async ps() {
    // Load one model first so that ps has something to show.
    await ollama.generate({ model: SMOL, prompt: 'Hi', options: { ...GREEDY, num_predict: 1 } })
    const r = await ollama.ps()
    return {
      names: r.models.map((m) => m.name),
      models: r.models.map((m) => ({
        name: m.name,
        size: m.size,
        size_vram: m.size_vram,
        expires_at: m.expires_at,
      })),
    }
  },

  async show() {
    const r = await ollama.show({ model: SMOL })
    return {
      family: r.details && r.details.family,
      format: r.details && r.details.format,
      parameter_size: r.details && r.details.parameter_size,
      capabilities: r.capabilities,
      template_length: (r.template || '').length,
      model_info_keys: Object.keys(r.model_info || {}),
      architecture: (r.model_info || {})['general.architecture'],
      capabilities_of: Object.fromEntries(
        await Promise.all(
          ['tools', 'think', 'embed'].map(async (m) => [m, (await ollama.show({ model: m })).capabilities]),
        ),
      ),
    }
  },

  async tools() {
    const r = await ollama.chat({
      model: 'tools',
      messages: [{ role: 'user', content: 'What is the weather in Paris?' }],
      tools: [WEATHER],
      options: { ...GREEDY, num_predict: 8 },
    })
    return {
      ...final(r),
      role: r.message.role,
      content: r.message.content,
      tool_calls: r.message.tool_calls || [],
    }
  },

  async think() {
    const r = await ollama.chat({
      model: 'think',
      messages: [{ role: 'user', content: 'hi' }],
      think: true,
      options: { num_predict: 8, seed: 1 },
    })
    const chunks = await collect(
      await ollama.chat({
        model: 'think',
        messages: [{ role: 'user', content: 'hi' }],
        think: true,
        stream: true,
        options: { num_predict: 8, seed: 1 },
      }),
    )
    return {
      ...final(r),
      thinking: r.message.thinking || '',
      content: r.message.content,
      streamed_thinking: chunks.map((c) => c.message.thinking || '').join(''),
      streamed_content: chunks.map((c) => c.message.content).join(''),
      streamed_last: final(chunks[chunks.length - 1]),
    }
  },

  async not_found() {
    return await ollama.chat({ model: 'nope', messages: [{ role: 'user', content: 'hi' }] })
  },
}

const out = {}
for (const name of process.argv.slice(2)) {
  const scenario = scenarios[name]
  if (!scenario) {
    console.error(`unknown scenario: ${name}`)
    process.exit(2)
  }
  try {
    out[name] = await scenario()
  } catch (e) {
    out[name] = { error: String(e.error ?? e.message ?? e), status_code: e.status_code ?? null, name: e.name }
  }
}
process.stdout.write(JSON.stringify(out) + '\n')
