// The API page (/api/docs): Swagger UI over this server's OpenAPI document. Its calls go to this page's own origin
// (the document's server comes second), so that try-it-out works behind any front, with the key given in Authorize.
(function () {
  'use strict';
  fetch('/api/openapi.json').then(function (answer) {
    return answer.json();
  }).then(function (spec) {
    var here = window.location.origin;
    spec.servers = [{url: here, description: 'This server'}].concat(
      (spec.servers || []).filter(function (server) { return server.url !== here; }));
    window.ui = SwaggerUIBundle({
      spec: spec,
      dom_id: '#swagger-ui',
      presets: [SwaggerUIBundle.presets.apis],
      layout: 'BaseLayout',
      validatorUrl: null,           // never ask validator.swagger.io: nothing leaves this server
      deepLinking: false,
      defaultModelsExpandDepth: 0
    });
  });
})();
