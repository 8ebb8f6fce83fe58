"""GET /api/health and GET /api/stats."""


def test_health(client):
    answer = client.get('/api/health')
    assert answer.status == 200
    assert answer.json == {'status': 'ok', 'version': '2.0.0', 'dbConnected': True, 'payments': 'simulated',
                           'rails': {'base': 'simulated', 'stripe': 'simulated'},
                           'replication': {'enabled': False, 'url': None}, 'role': 'primary'}
    assert answer.headers['Content-Type'] == 'application/json; charset=utf-8'


def test_health_is_503_when_the_database_cannot_be_read(settings):
    import wiring
    from conftest import Client
    app = wiring.make_app(settings)
    app.service.db.close()
    answer = Client(app).get('/api/health')
    assert answer.status == 503
    assert answer.json == {'status': 'unavailable', 'version': '2.0.0', 'dbConnected': False, 'payments': 'simulated',
                           'rails': {'base': 'simulated', 'stripe': 'simulated'},
                           'replication': {'enabled': False, 'url': None}, 'role': 'primary',
                           'error': 'The database cannot be read.', 'code': 'unavailable'}


def test_stats_count_jobs_and_released_money(client, market):
    job, claim = market.delivered_job(paymentAmount='30.00')
    market.verify(job, claim, True)
    usd_job, usd_claim = market.delivered_job(paymentAmount='7.25', paymentCurrency='USD')
    market.verify(usd_job, usd_claim, True)
    market.job(paymentAmount='99.00')
    rejected, rejected_claim = market.delivered_job(paymentAmount='5.00')
    market.verify(rejected, rejected_claim, False)
    assert client.get('/api/stats').json == {
        'totalJobs': 4, 'totalAgents': 1, 'totalUSDC': '30.00', 'totalUSD': '7.25', 'openJobs': 1,
        'completedJobs': 2, 'openDisputes': 0, 'totalArbitrators': 0}
