"""A ChatML chat template that renders tools, assistant tool calls and tool results in the Hermes style (the
``hermes`` parser's format), for models whose own template ignores them (SmolLM2-135M-Instruct's does)."""

HERMES_TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}You may call functions. The functions, as JSON schemas:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer <tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message['content'] %}{{ message['content'] }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
