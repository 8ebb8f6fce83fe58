"""Settings: one table, each a --flag and a MARKETPLACE_* variable."""

from decimal import Decimal

import pytest

import command_line
import marketplace as mp
import wiring


def test_defaults():
    settings = mp.load_settings({}, {})
    assert (settings.host, settings.port, settings.db) == ('127.0.0.1', 8080, 'marketplace.db')
    assert settings.fee_percent == Decimal('0')
    assert settings.open_registration is True and settings.trust_proxy is False
    assert settings.rate_limits == 'on' and settings.rate_limit_scale == 1.0
    assert settings.base_url == 'http://127.0.0.1:8080'


def test_environment_then_flags_win():
    environ = {'MARKETPLACE_PORT': '9000', 'MARKETPLACE_FEE_PERCENT': '2.5', 'MARKETPLACE_TRUST_PROXY': 'yes',
               'MARKETPLACE_OPEN_REGISTRATION': 'false', 'MARKETPLACE_PUBLIC_URL': 'https://jobs.example/'}
    settings = mp.load_settings({'port': '9100'}, environ)
    assert settings.port == 9100
    assert settings.fee_percent == Decimal('2.5')
    assert settings.trust_proxy is True and settings.open_registration is False
    assert settings.base_url == 'https://jobs.example'


def test_boolean_flags_from_the_command_line(monkeypatch):
    monkeypatch.setattr(command_line, 'serve', lambda settings, faces: seen.append(settings))
    seen = []
    wiring.main(['serve', '--no-open-registration', '--trust-proxy', '--fee-percent', '1.25', '--db', 'x.db'])
    assert seen[0].open_registration is False and seen[0].trust_proxy is True
    assert seen[0].fee_percent == Decimal('1.25') and seen[0].db == 'x.db'


@pytest.mark.parametrize('environ, message', [
    ({'MARKETPLACE_PORT': 'eighty'}, 'MARKETPLACE_PORT'),
    ({'MARKETPLACE_FEE_PERCENT': '101'}, 'from 0 to 100'),
    ({'MARKETPLACE_FEE_PERCENT': '2.555'}, 'two decimals'),
    ({'MARKETPLACE_RATE_LIMITS': 'maybe'}, 'on or off'),
    ({'MARKETPLACE_RATE_LIMIT_SCALE': '0'}, 'positive'),
    ({'MARKETPLACE_TRUST_PROXY': 'perhaps'}, 'true or false'),
])
def test_bad_values_are_refused_with_the_name(environ, message):
    with pytest.raises(ValueError, match=message):
        mp.load_settings({}, environ)


def test_every_setting_has_a_flag_and_a_variable():
    names = [s.name for s in mp.SETTINGS]
    assert len(names) == len(set(names))
    for setting in mp.SETTINGS:
        assert setting.env == 'MARKETPLACE_' + setting.name.upper()
        assert setting.flag == '--' + setting.name.replace('_', '-')
        assert setting.help


def test_unknown_settings_are_an_error():
    with pytest.raises(TypeError, match='nope'):
        mp.Settings(nope=1)
