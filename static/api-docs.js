// The API page (/api/docs): Swagger UI over this server's OpenAPI document. Its calls go to this page's own origin
// (the document's server comes second), so that try-it-out works behind any front, with the key given in Authorize.
(function () {
  'use strict';
  var root = document.getElementById('swagger-ui');
  fetch('/api/openapi.json').then(function (answer) {
    if (!answer.ok) {               // never a version error from Swagger UI: the page says what happened
      throw new Error(answer.status === 429
        ? 'rate limited, try again in ' + (answer.headers.get('Retry-After') || 'a few') + ' s'
        : 'the API document answered HTTP ' + answer.status);
    }
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
      defaultModelsExpandDepth: 0,
      responseInterceptor: function (answer) {     // a try-it-out call refused for its rate, said in words
        if (answer.status === 429) {
          var wait = answer.headers && (answer.headers['retry-after'] || answer.headers['Retry-After']);
          answer.statusText = 'rate limited, try again in ' + (wait || 'a few') + ' s';
        }
        return answer;
      }
    });
  }).catch(function (error) {
    var words = document.createElement('p');
    words.className = 'error';
    words.setAttribute('role', 'alert');
    words.textContent = 'The API document could not be read: ' + error.message + '.';
    root.appendChild(words);
  });
})();
