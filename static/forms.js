// The forms' progressive enhancement (the pages' CSP runs no inline script): focus on the first refused field or
// on the refusal's words, and signing an on-chain funding, or a release in contract mode, with the browser's wallet
// (EIP-1193) when there is one.
(function () {
  'use strict';
  function focusFirstError() {
    var target = document.querySelector('[aria-invalid="true"]') || document.querySelector('.error[role="alert"]');
    if (target && document.activeElement !== target) {
      target.focus();
    }
  }

  function walletSigning() {
    var button = document.getElementById('wallet-sign');
    var provider = window.ethereum;
    if (!button || !provider || typeof provider.request !== 'function') {
      return;
    }
    button.hidden = false;
    button.addEventListener('click', function () {
      var typed = JSON.parse(document.getElementById('funding-typed-data').textContent);
      typed.message.txHash = document.getElementById('escrowTxHash').value.trim().toLowerCase();
      provider.request({ method: 'eth_requestAccounts' }).then(function (accounts) {
        return provider.request({ method: 'eth_signTypedData_v4', params: [accounts[0], JSON.stringify(typed)] });
      }).then(function (signature) {
        document.getElementById('escrowSignature').value = signature;
      }).catch(function (error) {
        button.textContent = 'The wallet did not sign: ' + (error && error.message ? error.message : error);
      });
    });
  }

  // Contract mode: an Approve button whose form carries a Release (data-release) asks the wallet to sign it, so that
  // the worker is paid at once; a refusal, or no wallet, leaves the form as it is: approved the slow way.
  function releaseSigning() {
    var provider = window.ethereum;
    if (!provider || typeof provider.request !== 'function') {
      return;
    }
    Array.prototype.forEach.call(document.querySelectorAll('form[data-release]'), function (form) {
      var field = form.querySelector('input[name="releaseSignature"]');
      var note = form.querySelector('.release-note');
      var button = form.querySelector('button[type="submit"]');
      var signing = true;
      form.addEventListener('submit', function (event) {
        if (!signing || field.value) {
          return;
        }
        event.preventDefault();
        var typed = document.getElementById(form.getAttribute('data-release')).textContent;
        provider.request({ method: 'eth_requestAccounts' }).then(function (accounts) {
          return provider.request({ method: 'eth_signTypedData_v4', params: [accounts[0], typed] });
        }).then(function (signature) {
          field.value = signature;
          form.submit();
        }).catch(function (error) {
          signing = false;
          note.textContent = 'The wallet did not sign (' + (error && error.message ? error.message : error) +
            '). Approve without signing: the worker is paid after the contract\'s delay.';
          button.textContent = 'Approve without signing';
        });
      });
    });
  }

  // A copy button (the new key's), shown only where the script runs.
  function copyButtons() {
    Array.prototype.forEach.call(document.querySelectorAll('button[data-copy]'), function (button) {
      var field = document.getElementById(button.getAttribute('data-copy'));
      if (!field || !navigator.clipboard) {
        return;
      }
      button.hidden = false;
      button.addEventListener('click', function () {
        navigator.clipboard.writeText(field.value).then(function () {
          button.textContent = 'Copied';
        }, function () {
          field.select();
          button.textContent = 'Select it and copy (Ctrl+C)';
        });
      });
    });
  }

  document.addEventListener('DOMContentLoaded', function () {
    focusFirstError();
    walletSigning();
    releaseSigning();
    copyButtons();
  });
}());
