% rebase('base.tpl', title=title, stylesheets=['/static/swagger-ui/swagger-ui.css'], scripts=['/static/swagger-ui/swagger-ui-bundle.js', '/static/api-docs.js'])
<h1>API</h1>
<p>Every operation of <a href="/api/openapi.json">the OpenAPI document</a>. To try one that needs a key, press <em>Authorize</em> and paste an API key: the calls go to this server, with the key as <code>Authorization: Bearer</code>.</p>
<noscript><p>This page needs JavaScript; <a href="/api/openapi.json">the document itself</a> does not.</p></noscript>
<div id="swagger-ui" class="api-docs"></div>
